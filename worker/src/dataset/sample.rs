//! One sample (a JSONL line, or an element of a JSON array file) → a normalized conversation,
//! from any of the dataset formats users already have (docs/preprocessing.md, "Dataset
//! formats"): typed parts, LLaMA-Factory's sharegpt and OpenAI styles (ms-swift's standard
//! format is the latter) and LLaVA.
//!
//! Never silent about media: a tag in text that no medium fills, a medium that no tag
//! consumes, a media key beside typed parts, or audio is a bad sample naming what it saw.

use serde::Serialize;
use serde_json::{Map, Value};

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

impl VideoPart {
    fn whole(video: VideoSource) -> Self {
        VideoPart {
            video,
            fps: None,
            video_start: None,
            video_end: None,
        }
    }
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
    /// A Parquet row that cannot be read as a sample (a broken page, a column of another type).
    #[error("{0}")]
    Parquet(String),
    /// Neither a `messages` nor a `conversations` list: no format this reader knows.
    #[error("expected a \"messages\" or \"conversations\" list (keys: {0})")]
    UnknownFormat(String),
}

fn schema(msg: impl Into<String>) -> SampleError {
    SampleError::Schema(msg.into())
}

/// A dataset format, as `stoker dataset index` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `messages` whose content lists typed parts (`{"type": "image", "image": …}`): the
    /// Hugging Face / Qwen chat form; string content is allowed for turns without media.
    TypedParts,
    /// LLaMA-Factory's OpenAI style and ms-swift's standard format: `messages` with
    /// `role`/`content` strings, `<image>` / `<video>` tags, top-level `images` / `videos`.
    LlamaFactoryOpenai,
    /// LLaMA-Factory's sharegpt style: `conversations` with `from`/`value`, tags, top-level
    /// `images` / `videos`.
    LlamaFactorySharegpt,
    /// LLaVA: `from`/`value` turns, tags, the paths in `image` / `video` (a path or a list).
    Llava,
}

impl Format {
    pub const ALL: [Format; 4] = [
        Format::LlamaFactorySharegpt,
        Format::Llava,
        Format::LlamaFactoryOpenai,
        Format::TypedParts,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Format::TypedParts => "typed-parts",
            Format::LlamaFactoryOpenai => "llamafactory-openai",
            Format::LlamaFactorySharegpt => "llamafactory-sharegpt",
            Format::Llava => "llava",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// The formats a sample is written in: one, or several where it has nothing that tells them
/// apart (a text-only sharegpt line is LLaVA's too).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Formats(u8);

impl Formats {
    pub const ANY: Formats = Formats(0b1111);

    fn of(formats: &[Format]) -> Self {
        Formats(formats.iter().fold(0, |acc, f| acc | f.bit()))
    }

    /// The formats both allow (empty: the two samples are in different formats).
    pub fn and(self, other: Formats) -> Formats {
        Formats(self.0 & other.0)
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The stored form (the index keeps each shard's).
    pub fn bits(self) -> u8 {
        self.0
    }

    pub fn from_bits(bits: u32) -> anyhow::Result<Self> {
        anyhow::ensure!(
            bits != 0 && bits <= u32::from(Self::ANY.0),
            "no set of dataset formats is {bits:#x}"
        );
        Ok(Formats(bits as u8))
    }

    /// The name shown for these formats: the first of [`Format::ALL`] among them.
    pub fn name(self) -> &'static str {
        Format::ALL
            .into_iter()
            .find(|f| self.0 & f.bit() != 0)
            .map_or("none", Format::name)
    }
}

impl std::fmt::Display for Formats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = Format::ALL
            .into_iter()
            .filter(|x| self.0 & x.bit() != 0)
            .map(Format::name)
            .collect();
        f.write_str(&names.join(" or "))
    }
}

/// The placeholders of the tag formats, in text.
const IMAGE_TAG: &str = "<image>";
const VIDEO_TAG: &str = "<video>";
const AUDIO_TAG: &str = "<audio>";
/// Top-level keys that name media: each is read, or the sample is refused naming it.
const AUDIO_KEYS: [&str; 2] = ["audios", "audio"];
/// Keys listed in an error about a sample's shape, at most (a hostile line stays bounded).
const MAX_KEYS_SHOWN: usize = 12;

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
        Self::parse_detect(line).map(|(conversation, _)| conversation)
    }

    /// The conversation, and the formats the sample is written in.
    pub fn parse_detect(line: &[u8]) -> Result<(Self, Formats), SampleError> {
        let text = std::str::from_utf8(line).map_err(|e| SampleError::NotUtf8(e.valid_up_to()))?;
        let v: Value = serde_json::from_str(text).map_err(|e| SampleError::Json(e.to_string()))?;
        let obj = v
            .as_object()
            .ok_or_else(|| schema("a sample must be a JSON object"))?;
        let (list_key, list) = match (obj.get("messages"), obj.get("conversations")) {
            (Some(m), None) => ("messages", m),
            (None, Some(c)) => ("conversations", c),
            (Some(_), Some(_)) => {
                return Err(schema(
                    "both \"messages\" and \"conversations\": which one is the conversation?",
                ))
            }
            (None, None) => return Err(SampleError::UnknownFormat(keys_of(obj))),
        };
        if let Some(key) = AUDIO_KEYS.into_iter().find(|k| obj.contains_key(*k)) {
            return Err(schema(format!("audio is not supported (key \"{key}\")")));
        }
        let list = list
            .as_array()
            .ok_or_else(|| schema(format!("\"{list_key}\" must be a list")))?;
        let mut turns = list
            .iter()
            .enumerate()
            .map(|(i, t)| Turn::parse(list_key, i, t))
            .collect::<Result<Vec<_>, _>>()?;
        let shape = match turns.first().map(|t| t.shape) {
            Some(first) if turns.iter().any(|t| t.shape != first) => {
                return Err(schema(format!(
                    "\"{list_key}\" mixes role/content turns with from/value turns"
                )))
            }
            first => first.unwrap_or(Shape::RoleContent),
        };
        if let Some(system) = obj.get("system") {
            let system = system
                .as_str()
                .ok_or_else(|| schema("\"system\" must be a string"))?;
            // LLaMA-Factory's rule: a system turn of the conversation wins over the key.
            if turns.first().map(|t| t.role) != Some("system") {
                turns.insert(
                    0,
                    Turn {
                        role: "system",
                        content: Content::Text(system),
                        shape,
                    },
                );
            }
        }
        let media = ListedMedia::read(obj)?;
        let typed = turns.iter().any(|t| matches!(t.content, Content::Parts(_)));
        let (messages, formats) = if typed {
            (
                typed_messages(list_key, &turns, media)?,
                Formats::of(&[Format::TypedParts]),
            )
        } else {
            let formats = match (media.singular(), media.keys.is_empty(), shape) {
                (true, _, _) => Formats::of(&[Format::Llava]),
                (false, false, Shape::RoleContent) => Formats::of(&[Format::LlamaFactoryOpenai]),
                (false, false, Shape::FromValue) => Formats::of(&[Format::LlamaFactorySharegpt]),
                (false, true, Shape::RoleContent) => {
                    Formats::of(&[Format::LlamaFactoryOpenai, Format::TypedParts])
                }
                (false, true, Shape::FromValue) => {
                    Formats::of(&[Format::LlamaFactorySharegpt, Format::Llava])
                }
            };
            (tagged_messages(&turns, media)?, formats)
        };
        if !messages.iter().any(|m| m.role == "assistant") {
            return Err(schema("no assistant turn: nothing to train on"));
        }
        Ok((Conversation { messages }, formats))
    }
}

/// A sample's top-level keys, sorted and bounded, for a message about its format ("none" for
/// what is not a JSON object).
pub fn top_level_keys(line: &[u8]) -> String {
    match serde_json::from_slice::<Value>(line) {
        Ok(Value::Object(obj)) => keys_of(&obj),
        _ => "none".into(),
    }
}

/// A sample's top-level keys, sorted and bounded, for a message about its shape.
fn keys_of(obj: &Map<String, Value>) -> String {
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    let more = keys.len().saturating_sub(MAX_KEYS_SHOWN);
    keys.truncate(MAX_KEYS_SHOWN);
    let mut shown = keys.join(", ");
    if more > 0 {
        shown.push_str(&format!(" and {more} more"));
    }
    if shown.is_empty() {
        shown.push_str("none");
    }
    shown
}

/// How a format spells a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// `{"role": "user", "content": …}` (OpenAI, typed parts)
    RoleContent,
    /// `{"from": "human", "value": …}` (sharegpt, LLaVA)
    FromValue,
}

enum Content<'a> {
    Text(&'a str),
    Parts(&'a [Value]),
}

struct Turn<'a> {
    role: &'static str,
    content: Content<'a>,
    shape: Shape,
}

impl<'a> Turn<'a> {
    fn parse(list_key: &str, i: usize, t: &'a Value) -> Result<Self, SampleError> {
        let at = format!("{list_key}[{i}]");
        let obj = t
            .as_object()
            .ok_or_else(|| schema(format!("{at} must be an object")))?;
        let (role_key, content_key, shape) = if obj.contains_key("role") {
            ("role", "content", Shape::RoleContent)
        } else if obj.contains_key("from") {
            ("from", "value", Shape::FromValue)
        } else {
            return Err(schema(format!(
                "{at} has neither \"role\" nor \"from\" (keys: {})",
                keys_of(obj)
            )));
        };
        let name = obj[role_key]
            .as_str()
            .ok_or_else(|| schema(format!("{at}.{role_key} must be a string")))?;
        let role = match name {
            "user" | "human" => "user",
            "assistant" | "gpt" => "assistant",
            "system" => "system",
            "tool" | "function" | "observation" | "function_call" | "ipython" => {
                return Err(schema(format!(
                    "{at}.{role_key} {name:?}: tool-use turns are not supported"
                )))
            }
            other => {
                return Err(schema(format!(
                    "{at}.{role_key} {other:?} is not user/human, assistant/gpt or system"
                )))
            }
        };
        let content = match (obj.get(content_key), shape) {
            (Some(Value::String(s)), _) => Content::Text(s),
            (Some(Value::Array(parts)), Shape::RoleContent) => Content::Parts(parts),
            (_, Shape::RoleContent) => {
                return Err(schema(format!("{at}.content must be a string or a list")))
            }
            (_, Shape::FromValue) => return Err(schema(format!("{at}.value must be a string"))),
        };
        Ok(Turn {
            role,
            content,
            shape,
        })
    }
}

/// The media a tag format lists at the top level, in order.
struct ListedMedia {
    images: Vec<String>,
    videos: Vec<VideoSource>,
    /// The keys that listed any (never ignored: beside typed parts they are refused).
    keys: Vec<&'static str>,
    /// Every media key given, empty or not (what a message about the counts names).
    given: Vec<&'static str>,
}

impl ListedMedia {
    fn read(obj: &Map<String, Value>) -> Result<Self, SampleError> {
        let mut media = ListedMedia {
            images: Vec::new(),
            videos: Vec::new(),
            keys: Vec::new(),
            given: Vec::new(),
        };
        for (plural, singular) in [("images", "image"), ("videos", "video")] {
            let (key, value) = match (obj.get(plural), obj.get(singular)) {
                (Some(_), Some(_)) => {
                    return Err(schema(format!(
                        "both \"{plural}\" and \"{singular}\": which one lists the media?"
                    )))
                }
                (Some(v), None) => (plural, v),
                (None, Some(v)) => (singular, v),
                (None, None) => continue,
            };
            let items: &[Value] = match value {
                Value::Null => &[],
                Value::Array(items) => items,
                one => std::slice::from_ref(one),
            };
            media.given.push(key);
            if items.is_empty() {
                continue;
            }
            media.keys.push(key);
            for (i, item) in items.iter().enumerate() {
                let at = format!("{key}[{i}]");
                if plural == "images" {
                    media.images.push(listed_path(&at, item)?);
                } else {
                    media.videos.push(match item {
                        // A frame list (LLaMA-Factory): in `videos`, not LLaVA's `video`, whose
                        // list is of clips.
                        Value::Array(frames) if key == plural => frame_list(frames)
                            .map(VideoSource::Frames)
                            .map_err(|e| schema(format!("{at}: {e}")))?,
                        other => VideoSource::Clip(listed_path(&at, other)?),
                    });
                }
            }
        }
        Ok(media)
    }

    /// Listed under LLaVA's singular `image` / `video`.
    fn singular(&self) -> bool {
        self.keys.iter().any(|k| matches!(*k, "image" | "video"))
    }
}

/// A listed medium's path: a string, or `{"path": …}` as LLaMA-Factory and ms-swift allow.
fn listed_path(at: &str, item: &Value) -> Result<String, SampleError> {
    match item {
        Value::String(s) => Ok(s.clone()),
        Value::Object(o) => match o.get("path") {
            Some(Value::String(s)) => Ok(s.clone()),
            _ if o.contains_key("bytes") => Err(schema(format!(
                "{at}: embedded bytes are not read from JSON; store the medium as an object \
                 and name its path"
            ))),
            _ => Err(schema(format!("{at}: an object without a \"path\" string"))),
        },
        _ => Err(schema(format!("{at} must be a path"))),
    }
}

fn frame_list(frames: &[Value]) -> Result<Vec<String>, String> {
    if frames.is_empty() || frames.len() > MAX_LISTED_FRAMES {
        return Err(format!(
            "a frame list holds 1 to {MAX_LISTED_FRAMES} frames, not {}",
            frames.len()
        ));
    }
    frames
        .iter()
        .map(|f| f.as_str().map(str::to_string))
        .collect::<Option<_>>()
        .ok_or_else(|| "a frame list must hold paths".to_string())
}

/// Typed parts: media are parts; a tag in text is refused (it would train as literal text).
/// An image part without a path (`{"type": "image"}`, as the `datasets` library's vision sets
/// write it, with an optional `index`) takes the next image of the top-level `images` list:
/// the processor fills images in order, so an `index` other than that order, or a count that
/// differs, is refused.
fn typed_messages(
    list_key: &str,
    turns: &[Turn],
    media: ListedMedia,
) -> Result<Vec<Message>, SampleError> {
    let mut listed = media.images.into_iter();
    let mut taken = 0;
    let mut messages = Vec::with_capacity(turns.len());
    for (i, turn) in turns.iter().enumerate() {
        let content = match turn.content {
            Content::Text(s) => vec![Part::Text {
                text: s.to_string(),
            }],
            Content::Parts(parts) => parts
                .iter()
                .enumerate()
                .map(|(j, p)| {
                    let at = || format!("{list_key}[{i}].content[{j}]");
                    match parse_part(p).map_err(|e| schema(format!("{}: {e}", at())))? {
                        TypedPart::Part(part) => Ok(part),
                        TypedPart::Listed(index) => {
                            if index.is_some_and(|k| k != taken) {
                                return Err(schema(format!(
                                    "{}: image index {} but it is image {taken} of the sample \
                                     (images are filled in the order their parts appear)",
                                    at(),
                                    index.unwrap_or_default()
                                )));
                            }
                            taken += 1;
                            let image = listed.next().ok_or_else(|| {
                                schema(format!(
                                    "{}: image part without an \"image\" path, and no image \
                                     left in \"images\" for it ({} listed)",
                                    at(),
                                    taken - 1
                                ))
                            })?;
                            Ok(Part::Image { image })
                        }
                    }
                })
                .collect::<Result<_, _>>()?,
        };
        for tag in [IMAGE_TAG, VIDEO_TAG, AUDIO_TAG] {
            let n: usize = content
                .iter()
                .map(|p| match p {
                    Part::Text { text } => text.matches(tag).count(),
                    _ => 0,
                })
                .sum();
            if n > 0 {
                return Err(schema(format!(
                    "{n} {tag} tags in the text of typed parts, which no medium fills: typed \
                     parts name each medium as a part"
                )));
            }
        }
        messages.push(Message {
            role: turn.role.to_string(),
            content,
        });
    }
    let left = listed.len();
    if left > 0 || !media.videos.is_empty() {
        let key = media.keys.first().copied().unwrap_or("images");
        return Err(schema(format!(
            "\"{key}\" beside typed parts lists {} more media than the {taken} image parts \
             without a path take: name each medium as a part (or leave its path out to take \
             the next listed image), or use {IMAGE_TAG} / {VIDEO_TAG} tags in string content",
            left + media.videos.len()
        )));
    }
    Ok(messages)
}

/// A typed part, or an image part without a path: it takes a listed image (its `index`, if
/// given).
enum TypedPart {
    Part(Part),
    Listed(Option<u64>),
}

fn parse_part(p: &Value) -> Result<TypedPart, String> {
    let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
    let field = |name: &str| p.get(name).and_then(Value::as_str).map(str::to_string);
    let path = || {
        field("image")
            .or_else(|| field("path"))
            .or_else(|| field("image_url"))
    };
    match kind {
        "text" => field("text")
            .map(|text| TypedPart::Part(Part::Text { text }))
            .ok_or_else(|| "text part without a \"text\" string".to_string()),
        "image" | "image_url" => match (path(), p.get("index")) {
            (Some(image), _) => Ok(TypedPart::Part(Part::Image { image })),
            (None, None | Some(Value::Null)) => Ok(TypedPart::Listed(None)),
            (None, Some(i)) => i
                .as_u64()
                .map(|i| TypedPart::Listed(Some(i)))
                .ok_or_else(|| format!("image \"index\" {i} is not a non-negative integer")),
        },
        "video" => parse_video(p).map(|v| TypedPart::Part(Part::Video(v))),
        "audio" => Err("audio is not supported".into()),
        other => Err(format!("unsupported part type {other:?}")),
    }
}

/// `{"type": "video", "video": "a.mp4" | ["f0.jpg", …], "fps"?, "video_start"?, "video_end"?}`
/// (`sample_fps` is qwen-vl-utils' name for a frame list's rate).
fn parse_video(p: &Value) -> Result<VideoPart, String> {
    let video = match p.get("video").or_else(|| p.get("path")) {
        Some(Value::String(s)) => VideoSource::Clip(s.clone()),
        Some(Value::Array(frames)) => VideoSource::Frames(frame_list(frames)?),
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

/// Tag formats: each `<image>` / `<video>` in the text, in order over the turns, takes the next
/// listed medium of its kind; the counts must be equal (LLaMA-Factory's rule), so no medium is
/// dropped or moved and no tag trains as literal text.
fn tagged_messages(turns: &[Turn], media: ListedMedia) -> Result<Vec<Message>, SampleError> {
    let texts = || {
        turns.iter().filter_map(|t| match t.content {
            Content::Text(s) => Some(s),
            Content::Parts(_) => None,
        })
    };
    let count = |tag: &str| -> usize { texts().map(|s| s.matches(tag).count()).sum() };
    let audio = count(AUDIO_TAG);
    if audio > 0 {
        return Err(schema(format!(
            "audio is not supported ({audio} {AUDIO_TAG} tags)"
        )));
    }
    let listed = |n: usize, what: &str, plural: &str, singular: &str| {
        let key = media
            .given
            .iter()
            .find(|k| **k == plural || **k == singular)
            .map_or(format!("no \"{plural}\" key"), |k| format!("in \"{k}\""));
        format!("{n} {what} ({key})")
    };
    let images = media.images.len();
    let videos = media.videos.len();
    let (image_tags, video_tags) = (count(IMAGE_TAG), count(VIDEO_TAG));
    if image_tags != images || video_tags != videos {
        return Err(schema(format!(
            "{image_tags} {IMAGE_TAG} and {video_tags} {VIDEO_TAG} tags in the text but {} and \
             {}: each tag takes one medium, and each medium needs its tag",
            listed(images, "images", "images", "image"),
            listed(videos, "videos", "videos", "video"),
        )));
    }
    let mut images = media.images.into_iter().map(|image| Part::Image { image });
    let mut videos = media
        .videos
        .into_iter()
        .map(|v| Part::Video(VideoPart::whole(v)));
    let mut messages = Vec::with_capacity(turns.len());
    for turn in turns {
        let Content::Text(mut rest) = turn.content else {
            unreachable!("tag formats have string content only")
        };
        let mut content = Vec::new();
        // Each tag, the first of either kind, in turn.
        while let Some((at, tag)) = [IMAGE_TAG, VIDEO_TAG]
            .into_iter()
            .filter_map(|tag| rest.find(tag).map(|at| (at, tag)))
            .min_by_key(|(at, _)| *at)
        {
            if at > 0 {
                content.push(Part::Text {
                    text: rest[..at].to_string(),
                });
            }
            let medium = match tag {
                IMAGE_TAG => images.next(),
                _ => videos.next(),
            };
            content.push(medium.expect("tags counted above"));
            rest = &rest[at + tag.len()..];
        }
        if !rest.is_empty() || content.is_empty() {
            content.push(Part::Text {
                text: rest.to_string(),
            });
        }
        messages.push(Message {
            role: turn.role.to_string(),
            content,
        });
    }
    Ok(messages)
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

    /// A medium without its tag is never moved or dropped in silence: the sample is refused
    /// with both counts (LLaMA-Factory's rule, LLaVA's lines included).
    #[test]
    fn media_and_tags_must_match_in_number() {
        let err = |line: &[u8]| Conversation::parse(line).unwrap_err().to_string();
        let e = err(br#"{"image": "a.jpg", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}"#);
        assert!(
            e.contains("0 <image> and 0 <video> tags in the text but 1 images (in \"image\")"),
            "{e}"
        );
        let e = err(br#"{"messages": [{"role": "user", "content": "<image><image>Who?"}, {"role": "assistant", "content": "Two."}], "images": ["a.jpg"]}"#);
        assert!(e.contains("2 <image> and 0 <video> tags"), "{e}");
        assert!(e.contains("1 images (in \"images\")"), "{e}");
        // The issue's report: tags, and no media key at all.
        let e = err(br#"{"conversations": [{"from": "human", "value": "<image>Who?"}, {"from": "gpt", "value": "Two."}]}"#);
        assert!(e.contains("0 images (no \"images\" key)"), "{e}");
        let e = err(br#"{"messages": [{"role": "user", "content": "<video>?"}, {"role": "assistant", "content": "x"}], "videos": []}"#);
        assert!(
            e.contains("1 <video> tags") && e.contains("0 videos (in \"videos\")"),
            "{e}"
        );
    }

    /// A conversation's parts as short strings: `t:text`, `i:path`, `v:Clip("…")`.
    fn parts(m: &Message) -> Vec<String> {
        m.content
            .iter()
            .map(|p| match p {
                Part::Text { text } => format!("t:{text}"),
                Part::Image { image } => format!("i:{image}"),
                Part::Video(v) => format!("v:{:?}", v.video),
            })
            .collect()
    }

    /// LLaMA-Factory's multimodal demo line (also ms-swift's standard format), its sharegpt
    /// twin and a LLaVA line: one conversation, tags consumed in order.
    #[test]
    fn llamafactory_openai_and_sharegpt_and_llava_read_the_same() {
        let openai = br#"{"messages": [{"role": "user", "content": "<image>Who are they?"}, {"role": "assistant", "content": "Two people."}], "images": ["a.jpg"]}"#;
        let sharegpt = br#"{"conversations": [{"from": "human", "value": "<image>Who are they?"}, {"from": "gpt", "value": "Two people."}], "images": ["a.jpg"]}"#;
        let llava = br#"{"conversations": [{"from": "human", "value": "<image>Who are they?"}, {"from": "gpt", "value": "Two people."}], "image": "a.jpg"}"#;
        let typed = br#"{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"}, {"type": "text", "text": "Who are they?"}]}, {"role": "assistant", "content": "Two people."}]}"#;
        let want = Conversation::parse(typed).unwrap();
        for (line, format) in [
            (&openai[..], Format::LlamaFactoryOpenai),
            (sharegpt, Format::LlamaFactorySharegpt),
            (llava, Format::Llava),
            (typed, Format::TypedParts),
        ] {
            let (c, formats) = Conversation::parse_detect(line).unwrap();
            assert_eq!(c, want, "{}", format.name());
            assert_eq!(formats, Formats::of(&[format]));
        }
    }

    /// A tag may stand anywhere (the end of a turn, an assistant turn), an image may be named
    /// twice, images and videos interleave by their tags, a frame list is a video, `{"path"}`
    /// objects are paths; a top-level `system` is kept unless the conversation has its own.
    #[test]
    fn tags_anywhere_repeated_media_frames_and_the_system_key() {
        let line = br#"{"system": "Be brief.", "messages": [
            {"role": "user", "content": "Compare <image> with <video> and <image>"},
            {"role": "assistant", "content": "Same.<image>"},
            {"role": "user", "content": "And <video>?"},
            {"role": "assistant", "content": "Yes."}],
            "images": ["a.jpg", {"path": "b.jpg"}, "a.jpg"],
            "videos": ["v.mp4", ["f0.jpg", "f1.jpg"]]}"#;
        let c = Conversation::parse(line).unwrap();
        assert_eq!(c.messages[0].role, "system");
        assert_eq!(parts(&c.messages[0]), ["t:Be brief."]);
        assert_eq!(
            parts(&c.messages[1]),
            [
                "t:Compare ",
                "i:a.jpg",
                "t: with ",
                r#"v:Clip("v.mp4")"#,
                "t: and ",
                "i:b.jpg"
            ]
        );
        assert_eq!(parts(&c.messages[2]), ["t:Same.", "i:a.jpg"]);
        assert_eq!(
            parts(&c.messages[3]),
            ["t:And ", r#"v:Frames(["f0.jpg", "f1.jpg"])"#, "t:?"]
        );
        let own = br#"{"system": "ignored", "conversations": [{"from": "system", "value": "Mine."}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}"#;
        let c = Conversation::parse(own).unwrap();
        assert_eq!(c.messages.len(), 3);
        assert_eq!(parts(&c.messages[0]), ["t:Mine."]);
    }

    /// Text-only lines fit several formats; what tells them apart is detected.
    #[test]
    fn formats_are_detected_and_text_only_lines_fit_several() {
        let detect = |line: &[u8]| Conversation::parse_detect(line).unwrap().1;
        let plain_sharegpt = detect(br#"{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}"#);
        assert_eq!(
            plain_sharegpt,
            Formats::of(&[Format::LlamaFactorySharegpt, Format::Llava])
        );
        assert_eq!(plain_sharegpt.name(), "llamafactory-sharegpt");
        let plain_messages = detect(br#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "images": []}"#);
        assert_eq!(
            plain_messages,
            Formats::of(&[Format::LlamaFactoryOpenai, Format::TypedParts])
        );
        assert!(plain_sharegpt.and(plain_messages).is_empty());
        assert_eq!(
            plain_sharegpt.and(Formats::of(&[Format::Llava])).name(),
            "llava"
        );
        assert_eq!(
            plain_messages.to_string(),
            "llamafactory-openai or typed-parts"
        );
    }

    /// The `datasets` library's vision SFT sets: image parts without a path take the listed
    /// images in order; an index out of that order or counts that differ are refused.
    #[test]
    fn pathless_image_parts_take_the_listed_images_in_order() {
        let line = br#"{"messages": [{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "Compare"}, {"type": "image"}]}, {"role": "assistant", "content": [{"type": "text", "text": "Same."}]}], "images": ["a.jpg", "b.jpg"]}"#;
        let (c, formats) = Conversation::parse_detect(line).unwrap();
        assert_eq!(c.image_paths().collect::<Vec<_>>(), ["a.jpg", "b.jpg"]);
        assert_eq!(formats.to_string(), "typed-parts");
        let err = |line: &str| {
            Conversation::parse(line.as_bytes())
                .unwrap_err()
                .to_string()
        };
        let turns = |parts: &str| {
            format!(
                r#"[{{"role": "user", "content": [{parts}]}}, {{"role": "assistant", "content": "x"}}]"#
            )
        };
        let e = err(&format!(
            r#"{{"messages": {}, "images": ["a.jpg", "b.jpg"]}}"#,
            turns(r#"{"type": "image", "index": 1}, {"type": "image", "index": 0}"#)
        ));
        assert!(e.contains("image index 1 but it is image 0"), "{e}");
        let e = err(&format!(
            r#"{{"messages": {}, "images": ["a.jpg"]}}"#,
            turns(r#"{"type": "image"}, {"type": "image"}"#)
        ));
        assert!(
            e.contains("no image left in \"images\" for it (1 listed)"),
            "{e}"
        );
        let e = err(&format!(
            r#"{{"messages": {}, "images": ["a.jpg", "b.jpg"]}}"#,
            turns(r#"{"type": "image"}"#)
        ));
        assert!(
            e.contains("lists 1 more media than the 1 image parts"),
            "{e}"
        );
        let e = err(&format!(
            r#"{{"messages": {}}}"#,
            turns(r#"{"type": "image"}"#)
        ));
        assert!(
            e.contains("no image left in \"images\" for it (0 listed)"),
            "{e}"
        );
    }

    /// Audio, media keys beside typed parts, tags in typed text, embedded bytes, tool turns
    /// and unknown shapes: each refused naming what it saw.
    #[test]
    fn what_is_not_read_is_refused_by_name() {
        let err = |line: &[u8]| Conversation::parse(line).unwrap_err().to_string();
        let turns =
            r#"[{"role": "user", "content": "<audio>hi"}, {"role": "assistant", "content": "yo"}]"#;
        let e = err(format!(r#"{{"messages": {turns}, "audios": ["a.wav"]}}"#).as_bytes());
        assert!(e.contains("audio is not supported (key \"audios\")"), "{e}");
        let e = err(format!(r#"{{"messages": {turns}}}"#).as_bytes());
        assert!(e.contains("audio is not supported (1 <audio> tags)"), "{e}");
        let e = err(br#"{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"}]}, {"role": "assistant", "content": "x"}], "images": ["a.jpg"]}"#);
        assert!(
            e.contains("\"images\" beside typed parts lists 1 more media than the 0 image parts"),
            "{e}"
        );
        let e = err(br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "<image>?"}]}, {"role": "assistant", "content": "x"}]}"#);
        assert!(
            e.contains("1 <image> tags in the text of typed parts"),
            "{e}"
        );
        let e = err(br#"{"messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}], "images": [{"bytes": "AAAA"}]}"#);
        assert!(e.contains("images[0]: embedded bytes"), "{e}");
        let e = err(br#"{"messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}], "images": ["a.jpg"], "image": "b.jpg"}"#);
        assert!(e.contains("both \"images\" and \"image\""), "{e}");
        let e = err(br#"{"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{}"}]}"#);
        assert!(
            e.contains("conversations[1].from \"function_call\": tool-use turns"),
            "{e}"
        );
        let e = err(
            br#"{"messages": [{"role": "user", "content": "hi"}, {"from": "gpt", "value": "yo"}]}"#,
        );
        assert!(
            e.contains("mixes role/content turns with from/value"),
            "{e}"
        );
        let e = Conversation::parse(br#"{"instruction": "hi", "output": "yo"}"#).unwrap_err();
        assert_eq!(e, SampleError::UnknownFormat("instruction, output".into()));
        assert!(e.to_string().contains("(keys: instruction, output)"));
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
