//! One JSONL line → a normalized conversation, from the LLaVA or the messages style.

use serde::Serialize;
use serde_json::Value;

/// A message part, serialized the way chat templates expect (`{"type": "text", "text": …}`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Part {
    Text { text: String },
    Image { image: String },
}

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
    /// Image paths in the order the images appear in the conversation.
    pub fn image_paths(&self) -> impl Iterator<Item = &str> {
        self.messages.iter().flat_map(|m| {
            m.content.iter().filter_map(|p| match p {
                Part::Image { image } => Some(image.as_str()),
                Part::Text { .. } => None,
            })
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
            parse_llava(turns, obj.get("image"))?
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
        other => Err(format!("unsupported part type {other:?}")),
    }
}

/// LLaVA: `<image>` placeholders in the human turns, paths in `image` (string or list).
/// Images without a placeholder go to the front of the first human turn, as LLaVA does.
fn parse_llava(turns: &Value, image: Option<&Value>) -> Result<Conversation, SampleError> {
    let mut images: Vec<String> = match image {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| schema("\"image\" list must hold strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(schema("\"image\" must be a path or a list of paths")),
    };
    let list = turns
        .as_array()
        .ok_or_else(|| schema("\"conversations\" must be a list"))?;
    let placeholders: usize = list
        .iter()
        .filter_map(|t| t.get("value").and_then(Value::as_str))
        .map(|s| s.matches("<image>").count())
        .sum();
    if placeholders > images.len() {
        return Err(schema(format!(
            "{placeholders} <image> placeholders but {} image paths",
            images.len()
        )));
    }
    let unplaced: Vec<String> = images.drain(..images.len() - placeholders).collect();
    let mut next_image = images.into_iter();
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
            content.extend(unplaced.iter().map(|p| Part::Image { image: p.clone() }));
        }
        for (k, piece) in value.split("<image>").enumerate() {
            if k > 0 {
                let image = next_image.next().expect("placeholders counted above");
                content.push(Part::Image { image });
            }
            if !piece.is_empty() {
                content.push(Part::Text {
                    text: piece.to_string(),
                });
            }
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
