//! One JSONL line → a normalized conversation, from the LLaVA or the messages style.

use serde::Serialize;
use serde_json::Value;

/// A message part, serialized the way chat templates expect (`{"type": "text", "text": …}`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Part {
    Text { text: String },
    Image { image: String },
    Video(VideoPart),
}

/// A video in a conversation: a clip, or its frames already extracted (Qwen's own tooling
/// accepts both), with how to sample it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VideoPart {
    pub video: VideoSource,
    /// A clip: frames sampled per second (the preset's, 2, when absent). Frames: the rate
    /// they were extracted at (2 when absent), which dates them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fps: Option<f64>,
    /// A clip: only the frames from this second on…
    #[serde(skip_serializing_if = "Option::is_none")]
    pub video_start: Option<f64>,
    /// …up to this second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub video_end: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum VideoSource {
    Clip(String),
    Frames(Vec<String>),
}

/// An image or a video, in the order the conversation shows them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Media<'a> {
    Image(&'a str),
    Video(&'a VideoPart),
}

/// Most frames a frame-list video may name: the decode budget bounds a clip's frames,
/// this bounds a list's objects.
pub const MAX_LISTED_FRAMES: usize = 768;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    pub role: String,
    pub content: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Conversation {
    pub messages: Vec<Message>,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum SampleError {
    #[error("line is not UTF-8 (byte {0})")]
    NotUtf8(usize),
    #[error("invalid JSON: {0}")]
    Json(String),
    #[error("{0}")]
    Schema(String),
}

fn schema(msg: impl Into<String>) -> SampleError {
    SampleError::Schema(msg.into())
}

impl Conversation {
    /// Images and videos in the order they appear in the conversation.
    pub fn media(&self) -> impl Iterator<Item = Media<'_>> {
        self.messages.iter().flat_map(|m| {
            m.content.iter().filter_map(|p| match p {
                Part::Image { image } => Some(Media::Image(image)),
                Part::Video(v) => Some(Media::Video(v)),
                Part::Text { .. } => None,
            })
        })
    }

    /// Every object the sample reads: images, clips and listed frames, in order.
    pub fn object_paths(&self) -> impl Iterator<Item = &str> {
        self.media().flat_map(|m| {
            let paths: Vec<&str> = match m {
                Media::Image(p) => vec![p],
                Media::Video(v) => match &v.video {
                    VideoSource::Clip(p) => vec![p.as_str()],
                    VideoSource::Frames(ps) => ps.iter().map(String::as_str).collect(),
                },
            };
            paths
        })
    }

    /// Image paths in the order the images appear in the conversation.
    pub fn image_paths(&self) -> impl Iterator<Item = &str> {
        self.media().filter_map(|m| match m {
            Media::Image(p) => Some(p),
            Media::Video(_) => None,
        })
    }

    pub fn parse(line: &[u8]) -> Result<Self, SampleError> {
        let text = std::str::from_utf8(line).map_err(|e| SampleError::NotUtf8(e.valid_up_to()))?;
        let v: Value = serde_json::from_str(text).map_err(|e| SampleError::Json(e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| schema("a sample must be a JSON object"))?;
        let conv = if let Some(msgs) = obj.get("messages") {
            parse_messages(msgs)?
        } else if let Some(turns) = obj.get("conversations") {
            parse_llava(turns, obj.get("image"), obj.get("video"))?
        } else {
            return Err(schema(
                "expected a \"messages\" (chat) or \"conversations\" (LLaVA) field",
            ));
        };
        if !conv.messages.iter().any(|m| m.role == "assistant") {
            return Err(schema("no assistant turn: nothing to train on"));
        }
        Ok(conv)
    }
}

fn parse_messages(v: &Value) -> Result<Conversation, SampleError> {
    let list = v
        .as_array()
        .ok_or_else(|| schema("\"messages\" must be a list"))?;
    let mut messages = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| schema(format!("messages[{i}].role must be a string")))?;
        if !matches!(role, "system" | "user" | "assistant") {
            return Err(schema(format!(
                "messages[{i}].role {role:?} is not system, user or assistant"
            )));
        }
        let content = match m.get("content") {
            Some(Value::String(s)) => vec![Part::Text { text: s.clone() }],
            Some(Value::Array(parts)) => parts
                .iter()
                .enumerate()
                .map(|(j, p)| {
                    parse_part(p).map_err(|e| schema(format!("messages[{i}].content[{j}]: {e}")))
                })
                .collect::<Result<_, _>>()?,
            _ => {
                return Err(schema(format!(
                    "messages[{i}].content must be a string or a list"
                )))
            }
        };
        messages.push(Message {
            role: role.to_string(),
            content,
        });
    }
    Ok(Conversation { messages })
}

fn parse_part(p: &Value) -> Result<Part, String> {
    let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
    let field = |name: &str| p.get(name).and_then(Value::as_str).map(str::to_string);
    match kind {
        "text" => field("text")
            .map(|text| Part::Text { text })
            .ok_or_else(|| "text part without a \"text\" string".to_string()),
        "image" | "image_url" => field("image")
            .or_else(|| field("path"))
            .or_else(|| field("image_url"))
            .map(|image| Part::Image { image })
            .ok_or_else(|| "image part without an \"image\" path".to_string()),
        "video" => parse_video(p).map(Part::Video),
        other => Err(format!("unsupported part type {other:?}")),
    }
}

/// `{"type": "video", "video": "a.mp4" | ["f0.jpg", …], "fps"?, "video_start"?, "video_end"?}`
/// (`sample_fps` is qwen-vl-utils' name for a frame list's rate).
fn parse_video(p: &Value) -> Result<VideoPart, String> {
    let video = match p.get("video").or_else(|| p.get("path")) {
        Some(Value::String(s)) => VideoSource::Clip(s.clone()),
        Some(Value::Array(frames)) => {
            if frames.is_empty() || frames.len() > MAX_LISTED_FRAMES {
                return Err(format!(
                    "a frame list holds 1 to {MAX_LISTED_FRAMES} frames, not {}",
                    frames.len()
                ));
            }
            VideoSource::Frames(
                frames
                    .iter()
                    .map(|f| f.as_str().map(str::to_string))
                    .collect::<Option<_>>()
                    .ok_or("a frame list must hold paths")?,
            )
        }
        _ => return Err("video part without a \"video\" path or frame list".into()),
    };
    let seconds = |name: &str| -> Result<Option<f64>, String> {
        match p.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() && x >= 0.0 => Ok(Some(x)),
                _ => Err(format!("\"{name}\" must be a non-negative number")),
            },
        }
    };
    let fps = seconds("fps")?.or(seconds("sample_fps")?);
    if fps == Some(0.0) {
        return Err("\"fps\" must be above 0".into());
    }
    let (video_start, video_end) = (seconds("video_start")?, seconds("video_end")?);
    if let (Some(s), Some(e)) = (video_start, video_end) {
        if e <= s {
            return Err(format!("video_end {e} is not after video_start {s}"));
        }
    }
    if matches!(video, VideoSource::Frames(_)) && (video_start.is_some() || video_end.is_some()) {
        return Err("video_start / video_end apply to a clip, not a frame list".into());
    }
    Ok(VideoPart {
        video,
        fps,
        video_start,
        video_end,
    })
}

/// A LLaVA `image` or `video` field: a path or a list of paths.
fn llava_paths(field: &str, v: Option<&Value>) -> Result<Vec<String>, SampleError> {
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| schema(format!("\"{field}\" list must hold strings")))
            })
            .collect(),
        Some(_) => Err(schema(format!(
            "\"{field}\" must be a path or a list of paths"
        ))),
    }
}

/// One kind of LLaVA media: its parts in order, and those without a placeholder (they go to
/// the front of the first human turn, as LLaVA does).
struct LlavaMedia {
    tag: &'static str,
    placed: std::vec::IntoIter<Part>,
    unplaced: Vec<Part>,
}

impl LlavaMedia {
    fn new(tag: &'static str, mut parts: Vec<Part>, turns: &[Value]) -> Result<Self, SampleError> {
        let placeholders: usize = turns
            .iter()
            .filter_map(|t| t.get("value").and_then(Value::as_str))
            .map(|s| s.matches(tag).count())
            .sum();
        if placeholders > parts.len() {
            return Err(schema(format!(
                "{placeholders} {tag} placeholders but {} paths",
                parts.len()
            )));
        }
        let unplaced = parts.drain(..parts.len() - placeholders).collect();
        Ok(LlavaMedia {
            tag,
            placed: parts.into_iter(),
            unplaced,
        })
    }
}

/// LLaVA: `<image>` / `<video>` placeholders in the human turns, paths in `image` / `video`
/// (string or list).
fn parse_llava(
    turns: &Value,
    image: Option<&Value>,
    video: Option<&Value>,
) -> Result<Conversation, SampleError> {
    let list = turns
        .as_array()
        .ok_or_else(|| schema("\"conversations\" must be a list"))?;
    let images = llava_paths("image", image)?
        .into_iter()
        .map(|image| Part::Image { image })
        .collect();
    let videos = llava_paths("video", video)?
        .into_iter()
        .map(|v| {
            Part::Video(VideoPart {
                video: VideoSource::Clip(v),
                fps: None,
                video_start: None,
                video_end: None,
            })
        })
        .collect();
    let mut media = [
        LlavaMedia::new("<image>", images, list)?,
        LlavaMedia::new("<video>", videos, list)?,
    ];
    let mut messages = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let from = t
            .get("from")
            .and_then(Value::as_str)
            .ok_or_else(|| schema(format!("conversations[{i}].from must be a string")))?;
        let role = match from {
            "human" | "user" => "user",
            "gpt" | "assistant" => "assistant",
            "system" => "system",
            other => {
                return Err(schema(format!(
                    "conversations[{i}].from {other:?} is not human, gpt or system"
                )))
            }
        };
        let value = t
            .get("value")
            .and_then(Value::as_str)
            .ok_or_else(|| schema(format!("conversations[{i}].value must be a string")))?;
        let mut content = Vec::new();
        if role == "user" && !messages.iter().any(|m: &Message| m.role == "user") {
            for m in &mut media {
                content.append(&mut m.unplaced);
            }
        }
        let mut rest = value;
        // Each placeholder, first of either kind, in turn.
        while let Some((at, m)) = media
            .iter_mut()
            .filter_map(|m| rest.find(m.tag).map(|at| (at, m)))
            .min_by_key(|(at, _)| *at)
        {
            if at > 0 {
                content.push(Part::Text {
                    text: rest[..at].to_string(),
                });
            }
            content.push(m.placed.next().expect("placeholders counted above"));
            rest = &rest[at + m.tag.len()..];
        }
        if !rest.is_empty() {
            content.push(Part::Text {
                text: rest.to_string(),
            });
        }
        messages.push(Message {
            role: role.to_string(),
            content,
        });
    }
    Ok(Conversation { messages })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llava_places_images_at_their_placeholders() {
        let line = br#"{"image": ["a.jpg", "b.png"], "conversations": [
            {"from": "human", "value": "<image>\nCompare with <image>?"},
            {"from": "gpt", "value": "They differ."}]}"#;
        let c = Conversation::parse(line).unwrap();
        assert_eq!(c.image_paths().collect::<Vec<_>>(), ["a.jpg", "b.png"]);
        assert_eq!(
            c.messages[0].content[1],
            Part::Text {
                text: "\nCompare with ".into()
            }
        );
        assert_eq!(c.messages[1].role, "assistant");
    }

    #[test]
    fn llava_without_placeholder_puts_image_first() {
        let line = br#"{"image": "a.jpg", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}"#;
        let c = Conversation::parse(line).unwrap();
        assert_eq!(
            c.messages[0].content[0],
            Part::Image {
                image: "a.jpg".into()
            }
        );
    }

    #[test]
    fn messages_style_multi_image() {
        let line = br#"{"messages": [{"role": "user", "content": [{"type": "image", "image": "x/1.jpg"}, {"type": "text", "text": "What?"}, {"type": "image", "image": "2.png"}]}, {"role": "assistant", "content": "A cat."}]}"#;
        let c = Conversation::parse(line).unwrap();
        assert_eq!(c.image_paths().collect::<Vec<_>>(), ["x/1.jpg", "2.png"]);
    }

    #[test]
    fn videos_in_both_styles_in_order_with_images() {
        let line = br#"{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"}, {"type": "video", "video": "c/v.mp4", "fps": 1.5, "video_start": 2, "video_end": 4.5}, {"type": "video", "video": ["f0.jpg", "f1.jpg"], "sample_fps": 4}]}, {"role": "assistant", "content": "ok"}]}"#;
        let c = Conversation::parse(line).unwrap();
        let media: Vec<_> = c.media().collect();
        assert_eq!(media.len(), 3);
        assert_eq!(media[0], Media::Image("a.jpg"));
        let Media::Video(v) = media[1] else {
            panic!("a video")
        };
        assert_eq!(v.video, VideoSource::Clip("c/v.mp4".into()));
        assert_eq!(
            (v.fps, v.video_start, v.video_end),
            (Some(1.5), Some(2.0), Some(4.5))
        );
        let Media::Video(f) = media[2] else {
            panic!("a video")
        };
        assert_eq!(
            f.video,
            VideoSource::Frames(vec!["f0.jpg".into(), "f1.jpg".into()])
        );
        assert_eq!(f.fps, Some(4.0));
        // Templates see `{"type": "video", "video": …}`.
        let json = serde_json::to_value(&c.messages[0].content[1]).unwrap();
        assert_eq!(json["type"], "video");
        assert_eq!(json["video"], "c/v.mp4");

        let llava = br#"{"image": "a.jpg", "video": ["v1.mp4", "v2.mp4"], "conversations": [
            {"from": "human", "value": "<video> then <image> and <video>?"},
            {"from": "gpt", "value": "Yes."}]}"#;
        let c = Conversation::parse(llava).unwrap();
        let kinds: Vec<String> = c.messages[0]
            .content
            .iter()
            .map(|p| match p {
                Part::Text { text } => format!("t:{text}"),
                Part::Image { image } => format!("i:{image}"),
                Part::Video(v) => format!("v:{:?}", v.video),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                r#"v:Clip("v1.mp4")"#,
                "t: then ",
                "i:a.jpg",
                "t: and ",
                r#"v:Clip("v2.mp4")"#,
                "t:?"
            ]
        );
    }

    #[test]
    fn bad_video_parts_are_named() {
        let part = |p: &str| {
            let line = format!(
                r#"{{"messages": [{{"role": "user", "content": [{p}]}}, {{"role": "assistant", "content": "x"}}]}}"#
            );
            Conversation::parse(line.as_bytes())
                .unwrap_err()
                .to_string()
        };
        assert!(part(r#"{"type": "video"}"#).contains("without a \"video\""));
        assert!(part(r#"{"type": "video", "video": []}"#).contains("1 to 768 frames"));
        assert!(part(r#"{"type": "video", "video": "a.mp4", "fps": -1}"#).contains("non-negative"));
        assert!(
            part(r#"{"type": "video", "video": "a.mp4", "video_start": 3, "video_end": 2}"#)
                .contains("not after")
        );
        assert!(
            part(r#"{"type": "video", "video": ["a.jpg"], "video_start": 1}"#)
                .contains("frame list")
        );
    }

    #[test]
    fn bad_lines_name_the_problem() {
        assert!(matches!(
            Conversation::parse(b"{\"messages\": [}"),
            Err(SampleError::Json(_))
        ));
        assert!(matches!(
            Conversation::parse(b"{\"text\": \"\xff\"}"),
            Err(SampleError::NotUtf8(10))
        ));
        let e = Conversation::parse(br#"{"messages": [{"role": "user", "content": "hi"}]}"#)
            .unwrap_err();
        assert!(e.to_string().contains("no assistant turn"));
        let e = Conversation::parse(br#"{"messages": [{"role": "bot", "content": "hi"}]}"#)
            .unwrap_err();
        assert!(e.to_string().contains("messages[0].role"));
    }
}
