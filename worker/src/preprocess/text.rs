//! Conversation → token ids and labels: chat template (minijinja), real tokenizer, image-pad
//! expansion, assistant-only labels and truncation.

use super::preset::Preset;
use crate::dataset::sample::{Conversation, Message, Part};
use std::path::Path;
use tokenizers::Tokenizer;

pub const IGNORE_INDEX: i64 = -100;

/// Mark where each assistant turn's content starts and ends in a single render: Unicode
/// noncharacters, removed before tokenizing. A sample whose text holds one is rendered the
/// slower way (one render per conversation prefix).
const CONTENT_OPEN: char = '\u{FDD0}';
const CONTENT_CLOSE: char = '\u{FDD1}';

/// Rendered chat text and the byte spans of it that are trained on.
type Rendered = (String, Vec<Span>);
type Span = (usize, usize);

/// Qwen2-VL / Qwen2.5-VL's vision-language chat template (as published with the models).
pub const QWEN2_VL_TEMPLATE: &str = include_str!("../../templates/qwen2-vl.jinja");

/// Qwen3-VL's format for image/text conversations: the same turns, no default system prompt.
pub const QWEN3_VL_TEMPLATE: &str = include_str!("../../templates/qwen3-vl.jinja");

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TextError {
    #[error("chat template failed: {0}")]
    Template(String),
    #[error("tokenizer failed: {0}")]
    Tokenizer(String),
    #[error("the template rendered {rendered} image placeholders for {images} images")]
    ImageCount { rendered: usize, images: usize },
    #[error("sample has {len} tokens; truncated to max_length {max} it keeps no assistant token")]
    TooLong { len: usize, max: usize },
}

/// The tokenized sample. `kept_images` < the number of images when truncation cut some off.
#[derive(Debug, Clone)]
pub struct Tokenized {
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub kept_images: usize,
    pub truncated: bool,
    /// The rendered chat text (one placeholder per image), for `dataset inspect`.
    pub text: String,
}

pub struct TextProcessor {
    tokenizer: Tokenizer,
    env: minijinja::Environment<'static>,
    image_pad: u32,
    vision_start: u32,
    vision_end: u32,
    pub pad_id: i64,
    max_length: usize,
    /// What the template writes after an assistant turn's content (`<|im_end|>\n`), trained
    /// on with it; learned from the template once. `None`: a template the single render does
    /// not describe exactly, rendered once per conversation prefix instead.
    turn_end: Option<String>,
    /// Identifies the tokenizer and template (part of the plan identity).
    pub fingerprint: u64,
}

fn token_id(t: &Tokenizer, s: &str) -> anyhow::Result<u32> {
    t.token_to_id(s)
        .ok_or_else(|| anyhow::anyhow!("tokenizer has no {s} token: not a Qwen-VL tokenizer"))
}

/// The `chat_template` of a chat_template.json or tokenizer_config.json, if present.
fn template_from_json(path: &Path) -> anyhow::Result<Option<String>> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(path)?)
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(match v.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        // A list of named templates: take "default".
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    })
}

impl TextProcessor {
    /// The token id an image's placeholder expands to (one per merged patch).
    pub fn image_token(&self) -> i64 {
        self.image_pad.into()
    }

    /// `tokenizer` is a tokenizer.json or a folder holding one. `template` overrides the
    /// preset's built-in format: a .jinja file, or a chat_template.json / tokenizer_config.json.
    pub fn load(
        tokenizer: &Path,
        template: Option<&Path>,
        preset: &Preset,
    ) -> anyhow::Result<Self> {
        let file = if tokenizer.is_dir() {
            tokenizer.join("tokenizer.json")
        } else {
            tokenizer.to_path_buf()
        };
        let json = std::fs::read(&file)
            .map_err(|e| anyhow::anyhow!("reading tokenizer {}: {e}", file.display()))?;
        let source = match template {
            None => match preset.default_system() {
                Some(_) => QWEN2_VL_TEMPLATE.to_string(),
                None => QWEN3_VL_TEMPLATE.to_string(),
            },
            Some(p) if p.extension().is_some_and(|e| e == "json") => template_from_json(p)?
                .ok_or_else(|| anyhow::anyhow!("{} has no chat_template", p.display()))?,
            Some(p) => std::fs::read_to_string(p)
                .map_err(|e| anyhow::anyhow!("reading template {}: {e}", p.display()))?,
        };
        Self::new(&json, source, preset)
            .map_err(|e| anyhow::anyhow!("tokenizer {}: {e}", file.display()))
    }

    /// From the bytes of a tokenizer.json and a chat template's source.
    pub fn new(tokenizer_json: &[u8], template: String, preset: &Preset) -> anyhow::Result<Self> {
        let tokenizer =
            Tokenizer::from_bytes(tokenizer_json).map_err(|e| anyhow::anyhow!("{e}"))?;
        let fingerprint =
            crate::dataset::index::fingerprint(&[tokenizer_json, template.as_bytes()]);
        let mut env = minijinja::Environment::new();
        // transformers renders chat templates with trim_blocks and lstrip_blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Hugging Face templates are Jinja2 with Python string methods.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", template)
            .map_err(|e| anyhow::anyhow!("chat template does not parse: {e}"))?;
        let pad_id = tokenizer
            .token_to_id("<|endoftext|>")
            .map(i64::from)
            .unwrap_or(0);
        let mut text = TextProcessor {
            image_pad: token_id(&tokenizer, "<|image_pad|>")?,
            vision_start: token_id(&tokenizer, "<|vision_start|>")?,
            vision_end: token_id(&tokenizer, "<|vision_end|>")?,
            tokenizer,
            env,
            pad_id,
            max_length: preset.max_length,
            turn_end: None,
            fingerprint,
        };
        text.turn_end = text.learn_turn_end();
        Ok(text)
    }

    /// Renders the conversation's first `n` messages.
    pub fn render(
        &self,
        conv: &Conversation,
        n: usize,
        generation_prompt: bool,
    ) -> Result<String, TextError> {
        let tmpl = self.env.get_template("chat").expect("added in new()");
        tmpl.render(minijinja::context! {
            messages => &conv.messages[..n],
            add_generation_prompt => generation_prompt,
            add_vision_id => false,
        })
        .map_err(|e| TextError::Template(e.to_string()))
    }

    /// Byte spans of the rendered text that are trained on: each assistant turn's content and
    /// its closing tokens. Derived from the template itself — the text of a prefix of the
    /// conversation is a prefix of the text, and the generation prompt marks where the
    /// assistant's content starts — so a user's template needs no annotations.
    fn assistant_spans(
        &self,
        conv: &Conversation,
        full: &str,
    ) -> Result<Vec<(usize, usize)>, TextError> {
        let mut spans = Vec::new();
        for (i, m) in conv.messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let start = self.render(conv, i, true)?;
            let end = self.render(conv, i + 1, false)?;
            if !full.starts_with(&end) || !end.starts_with(&start) {
                return Err(TextError::Template(
                    "the template does not render conversation prefixes as text prefixes, so assistant turns cannot be located for labels".into(),
                ));
            }
            spans.push((start.len(), end.len()));
        }
        Ok(spans)
    }

    /// The rendered text and the byte spans trained on: from one render with the content of
    /// each assistant turn marked when the template allows, else from prefix renders.
    fn render_with_spans(&self, conv: &Conversation) -> Result<Rendered, TextError> {
        if let Some(turn_end) = &self.turn_end {
            if let Some(found) = self.marked_render(conv, turn_end)? {
                return Ok(found);
            }
        }
        let text = self.render(conv, conv.messages.len(), false)?;
        let spans = self.assistant_spans(conv, &text)?;
        Ok((text, spans))
    }

    /// One render with each assistant turn's content between markers; `None` when the
    /// sample's own text holds a marker or the markers do not come out as expected.
    fn marked_render(
        &self,
        conv: &Conversation,
        turn_end: &str,
    ) -> Result<Option<Rendered>, TextError> {
        let holds_marker = conv.messages.iter().flat_map(|m| &m.content).any(
            |p| matches!(p, Part::Text { text } if text.contains([CONTENT_OPEN, CONTENT_CLOSE])),
        );
        if holds_marker {
            return Ok(None);
        }
        let rendered = self.render(&marked(conv), conv.messages.len(), false)?;
        let mut text = String::with_capacity(rendered.len());
        let mut spans = Vec::new();
        let mut open = None;
        for piece in rendered.split_inclusive([CONTENT_OPEN, CONTENT_CLOSE]) {
            let (body, marker) = match piece.strip_suffix([CONTENT_OPEN, CONTENT_CLOSE]) {
                Some(body) => (body, piece.chars().last()),
                None => (piece, None),
            };
            text.push_str(body);
            match (marker, open) {
                (Some(CONTENT_OPEN), None) => open = Some(text.len()),
                (Some(CONTENT_CLOSE), Some(start)) => {
                    spans.push((start, text.len()));
                    open = None;
                }
                (None, _) => {}
                _ => return Ok(None),
            }
        }
        let assistants = conv.messages.iter().filter(|m| m.role == "assistant");
        if open.is_some() || spans.len() != assistants.count() {
            return Ok(None);
        }
        for span in &mut spans {
            if !text[span.1..].starts_with(turn_end) {
                return Ok(None);
            }
            span.1 += turn_end.len();
        }
        Ok(Some((text, spans)))
    }

    /// What the template writes after an assistant turn's content, if a single marked render
    /// gives exactly the text and spans that prefix renders give, on a probe conversation.
    fn learn_turn_end(&self) -> Option<String> {
        let turn = |role: &str, text: &str| Message {
            role: role.into(),
            content: vec![Part::Text { text: text.into() }],
        };
        let probe = Conversation {
            messages: vec![
                turn("user", "Hi"),
                turn("assistant", " a \n"),
                turn("user", "More?"),
                turn("assistant", "b"),
            ],
        };
        let text = self.render(&probe, probe.messages.len(), false).ok()?;
        let spans = self.assistant_spans(&probe, &text).ok()?;
        let rendered = self.render(&marked(&probe), 2, false).ok()?;
        let content_end = rendered.find(CONTENT_CLOSE)? - CONTENT_OPEN.len_utf8();
        let turn_end = text.get(content_end..spans.first()?.1)?.to_string();
        let single = self.marked_render(&probe, &turn_end).ok()??;
        (single == (text, spans)).then_some(turn_end)
    }

    /// Tokenizes `conv`, expanding image `k`'s placeholder to `image_tokens[k]` pad tokens.
    pub fn tokenize(
        &self,
        conv: &Conversation,
        image_tokens: &[usize],
    ) -> Result<Tokenized, TextError> {
        let (text, spans) = self.render_with_spans(conv)?;
        let enc = self
            .tokenizer
            .encode(text.as_str(), true)
            .map_err(|e| TextError::Tokenizer(e.to_string()))?;
        let rendered = enc
            .get_ids()
            .iter()
            .filter(|&&t| t == self.image_pad)
            .count();
        if rendered != image_tokens.len() {
            return Err(TextError::ImageCount {
                rendered,
                images: image_tokens.len(),
            });
        }
        let total: usize = enc.len() - rendered + image_tokens.iter().sum::<usize>();
        let mut input_ids = Vec::with_capacity(total);
        let mut labels = Vec::with_capacity(total);
        let mut next_image = image_tokens.iter();
        for (&id, &(s, _)) in enc.get_ids().iter().zip(enc.get_offsets()) {
            if id == self.image_pad {
                let n = *next_image.next().expect("counted above");
                input_ids.extend(std::iter::repeat_n(id as i64, n));
                labels.extend(std::iter::repeat_n(IGNORE_INDEX, n));
                continue;
            }
            input_ids.push(id as i64);
            let trained = spans.iter().any(|&(a, b)| s >= a && s < b);
            labels.push(if trained { id as i64 } else { IGNORE_INDEX });
        }
        let mut tok = self.truncate(input_ids, labels, image_tokens.len())?;
        tok.text = text;
        Ok(tok)
    }

    /// Truncation policy: keep the first `max_length` tokens, but never cut inside an image's
    /// `<|vision_start|> … <|vision_end|>` run — the cut moves before it and that image (and
    /// any later one) is dropped with its pixels. A sample left with no trained token fails.
    fn truncate(
        &self,
        mut ids: Vec<i64>,
        mut labels: Vec<i64>,
        images: usize,
    ) -> Result<Tokenized, TextError> {
        let len = ids.len();
        if len <= self.max_length {
            return Ok(Tokenized {
                input_ids: ids,
                labels,
                kept_images: images,
                truncated: false,
                text: String::new(),
            });
        }
        let mut cut = self.max_length;
        let (vs, ve) = (self.vision_start as i64, self.vision_end as i64);
        if let Some(open) = ids[..cut].iter().rposition(|&t| t == vs) {
            let closed = ids[open..cut].contains(&ve);
            if !closed {
                cut = open;
            }
        }
        ids.truncate(cut);
        labels.truncate(cut);
        if labels.iter().all(|&l| l == IGNORE_INDEX) {
            return Err(TextError::TooLong {
                len,
                max: self.max_length,
            });
        }
        let kept_images = ids.iter().filter(|&&t| t == ve).count();
        Ok(Tokenized {
            input_ids: ids,
            labels,
            kept_images,
            truncated: true,
            text: String::new(),
        })
    }
}

/// `conv` with each assistant turn's content between the content markers.
fn marked(conv: &Conversation) -> Conversation {
    let mark = |c: char| Part::Text {
        text: c.to_string(),
    };
    let messages = conv
        .messages
        .iter()
        .map(|m| match m.role.as_str() {
            "assistant" => Message {
                role: m.role.clone(),
                content: std::iter::once(mark(CONTENT_OPEN))
                    .chain(m.content.iter().cloned())
                    .chain([mark(CONTENT_CLOSE)])
                    .collect(),
            },
            _ => m.clone(),
        })
        .collect();
    Conversation { messages }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoker_config::{Preprocessing, PresetName};

    fn processor(preset: PresetName, template: Option<&str>) -> TextProcessor {
        let pre = Preprocessing {
            preset,
            ..Default::default()
        };
        let dir = crate::tokenizer_source::local_path(&pre).unwrap();
        let json = std::fs::read(dir.join("tokenizer.json")).unwrap();
        let p = Preset::from_config(&pre);
        match template {
            Some(t) => TextProcessor::new(&json, t.into(), &p).unwrap(),
            None => TextProcessor::load(&dir, None, &p).unwrap(),
        }
    }

    /// The spans of the one marked render, as prefix renders find them.
    fn spans_both_ways(t: &TextProcessor, line: &str) -> (Vec<Span>, Vec<Span>) {
        let conv = Conversation::parse(line.as_bytes()).unwrap();
        let (text, once) = t.render_with_spans(&conv).unwrap();
        assert_eq!(text, t.render(&conv, conv.messages.len(), false).unwrap());
        (once, t.assistant_spans(&conv, &text).unwrap())
    }

    const SAMPLES: [&str; 3] = [
        r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "image", "image": "a.jpg"}, {"type": "text", "text": "What?"}]}, {"role": "assistant", "content": " A cat.\n"}, {"role": "user", "content": "And?"}, {"role": "assistant", "content": [{"type": "text", "text": "Two"}, {"type": "text", "text": " parts"}]}]}"#,
        r#"{"image": ["a.jpg", "b.jpg"], "conversations": [{"from": "human", "value": "<image>\nCompare <image>"}, {"from": "gpt", "value": "Same."}, {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": ""}]}"#,
        r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "says \ufdd0 a marker"}]}"#,
    ];

    #[test]
    fn one_render_finds_the_spans_prefix_renders_find() {
        for preset in [PresetName::Qwen2Vl, PresetName::Qwen3Vl] {
            let t = processor(preset, None);
            assert_eq!(t.turn_end.as_deref(), Some("<|im_end|>\n"), "{preset:?}");
            for line in SAMPLES {
                let (once, per_prefix) = spans_both_ways(&t, line);
                assert_eq!(once, per_prefix, "{preset:?}: {line}");
                assert!(!once.is_empty());
            }
        }
        // The sample that holds a marker is the one rendered the slow way.
        let t = processor(PresetName::Qwen2Vl, None);
        let marked_text = |line: &str| {
            let conv = Conversation::parse(line.as_bytes()).unwrap();
            t.marked_render(&conv, "<|im_end|>\n").unwrap().is_some()
        };
        assert_eq!(SAMPLES.map(marked_text), [true, true, false]);
    }

    /// A template that renders only each message's first part: the markers cannot describe it,
    /// the probe sees so, and every sample is rendered per prefix (the labels stay right).
    #[test]
    fn a_template_the_markers_cannot_describe_is_rendered_per_prefix() {
        let first_part = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'][0]['text'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let t = processor(PresetName::Qwen2Vl, Some(first_part));
        assert_eq!(t.turn_end, None);
        let line = r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#;
        let conv = Conversation::parse(line.as_bytes()).unwrap();
        let (text, spans) = t.render_with_spans(&conv).unwrap();
        assert_eq!(&text[spans[0].0..spans[0].1], "yo<|im_end|>\n");
    }
}
