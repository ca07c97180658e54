//! Conversation → token ids and labels: chat template (minijinja), real tokenizer, image-pad
//! expansion, assistant-only labels and truncation.

use super::preset::Preset;
use crate::dataset::sample::Conversation;
use std::path::Path;
use tokenizers::Tokenizer;

pub const IGNORE_INDEX: i64 = -100;

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
        Ok(TextProcessor {
            image_pad: token_id(&tokenizer, "<|image_pad|>")?,
            vision_start: token_id(&tokenizer, "<|vision_start|>")?,
            vision_end: token_id(&tokenizer, "<|vision_end|>")?,
            tokenizer,
            env,
            pad_id,
            max_length: preset.max_length,
            fingerprint,
        })
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

    /// Tokenizes `conv`, expanding image `k`'s placeholder to `image_tokens[k]` pad tokens.
    pub fn tokenize(
        &self,
        conv: &Conversation,
        image_tokens: &[usize],
    ) -> Result<Tokenized, TextError> {
        let text = self.render(conv, conv.messages.len(), false)?;
        let spans = self.assistant_spans(conv, &text)?;
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
