//! Conversation → token ids and labels: chat template (minijinja), real tokenizer, image-pad
//! expansion, assistant-only labels and truncation.

use super::preset::Preset;
use super::video::VideoTokens;
use crate::dataset::sample::{Conversation, Message, Part};
use crate::source::{read_file_at_most, TEMPLATE_CAP, TOKENIZER_CAP};
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
    #[error("the template rendered {rendered} video placeholders for {videos} videos")]
    VideoCount { rendered: usize, videos: usize },
    #[error("sample has {len} tokens; truncated to max_length {max} it keeps no assistant token")]
    TooLong { len: usize, max: usize },
}

/// What one image or video of a sample expands to, in conversation order.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaTokens {
    /// `<|image_pad|>` × n.
    Image(usize),
    Video(VideoTokens),
}

/// The tokenized sample. `kept_images` (`kept_videos`) < the number of images (videos) when
/// truncation cut some off.
#[derive(Debug, Clone)]
pub struct Tokenized {
    pub input_ids: Vec<i64>,
    pub labels: Vec<i64>,
    pub kept_images: usize,
    pub kept_videos: usize,
    pub truncated: bool,
    /// The rendered chat text (one placeholder per image), for `dataset inspect`.
    pub text: String,
}

pub struct TextProcessor {
    tokenizer: Tokenizer,
    env: minijinja::Environment<'static>,
    image_pad: u32,
    video_pad: u32,
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
    let json = read_file_at_most(path, TOKENIZER_CAP)
        .map_err(|e| anyhow::anyhow!("reading template {}: {e}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_slice(&json).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
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

    /// The token a video's placeholder expands to.
    pub fn video_token(&self) -> i64 {
        self.video_pad.into()
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
        let json = read_file_at_most(&file, TOKENIZER_CAP)
            .map_err(|e| anyhow::anyhow!("reading tokenizer {}: {e}", file.display()))?;
        let source = match template {
            None => match preset.default_system() {
                Some(_) => QWEN2_VL_TEMPLATE.to_string(),
                None => QWEN3_VL_TEMPLATE.to_string(),
            },
            Some(p) if p.extension().is_some_and(|e| e == "json") => template_from_json(p)?
                .ok_or_else(|| anyhow::anyhow!("{} has no chat_template", p.display()))?,
            Some(p) => read_file_at_most(p, TEMPLATE_CAP)
                .and_then(|b| Ok(String::from_utf8(b)?))
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
            video_pad: token_id(&tokenizer, "<|video_pad|>")?,
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

    /// Tokenizes `conv`, expanding its images' and videos' placeholders as `media` says (in
    /// conversation order): an image's `<|image_pad|>` to n pads, a video's `<|video_pad|>` to
    /// its pads, Qwen3-VL's dated per temporal group (`<t seconds>`, then the group's vision
    /// span: the text is rewritten before tokenizing, as transformers' processor does).
    pub fn tokenize(
        &self,
        conv: &Conversation,
        media: &[MediaTokens],
    ) -> Result<Tokenized, TextError> {
        let (mut text, mut spans) = self.render_with_spans(conv)?;
        let images = media.iter().filter(|m| matches!(m, MediaTokens::Image(_)));
        let videos: Vec<&VideoTokens> = media
            .iter()
            .filter_map(|m| match m {
                MediaTokens::Video(v) => Some(v),
                MediaTokens::Image(_) => None,
            })
            .collect();
        let (image_count, video_count) = (images.count(), videos.len());
        // Each placeholder's byte span in the text, in order, and its media's kind.
        let places = placeholders(&text);
        let rendered_images = places.iter().filter(|p| p.kind == Kind::Image).count();
        let rendered_videos = places.len() - rendered_images;
        if rendered_images != image_count {
            return Err(TextError::ImageCount {
                rendered: rendered_images,
                images: image_count,
            });
        }
        if rendered_videos != video_count {
            return Err(TextError::VideoCount {
                rendered: rendered_videos,
                videos: video_count,
            });
        }
        // Qwen3-VL: the video's pad becomes per-group placeholders (back to front, so earlier
        // positions hold); spans after a rewrite shift by its growth.
        let mut media_spans: Vec<(usize, usize)> = places.iter().map(|p| p.span).collect();
        let mut video_k = video_count;
        for (k, place) in places.iter().enumerate().rev() {
            if place.kind != Kind::Video {
                continue;
            }
            video_k -= 1;
            let v = videos[video_k];
            if v.timestamps.is_empty() {
                continue;
            }
            let pad = "<|video_pad|>";
            let mut dated = String::new();
            for t in &v.timestamps {
                dated += &format!(
                    "<{} seconds><|vision_start|>{pad}<|vision_end|>",
                    one_decimal(*t)
                );
            }
            let grow = dated.len() - pad.len();
            let at = place.pad;
            text.replace_range(at..at + pad.len(), &dated);
            media_spans[k].1 += grow;
            for later in &mut media_spans[k + 1..] {
                later.0 += grow;
                later.1 += grow;
            }
            for span in &mut spans {
                if span.0 >= at + pad.len() {
                    span.0 += grow;
                }
                if span.1 >= at + pad.len() {
                    span.1 += grow;
                }
            }
        }
        let enc = self
            .tokenizer
            .encode(text.as_str(), true)
            .map_err(|e| TextError::Tokenizer(e.to_string()))?;
        // Pads per run, in text order: an image's one run, a video's one run or one per group.
        let mut runs = Vec::new();
        let mut video_k = 0;
        let mut image_tokens = media.iter().filter_map(|m| match m {
            MediaTokens::Image(n) => Some(*n),
            MediaTokens::Video(_) => None,
        });
        for place in &places {
            match place.kind {
                Kind::Image => runs.push((self.image_pad, image_tokens.next().expect("counted"))),
                Kind::Video => {
                    let v = videos[video_k];
                    video_k += 1;
                    match v.timestamps.is_empty() {
                        true => runs.push((self.video_pad, v.groups * v.per_group)),
                        false => runs.extend((0..v.groups).map(|_| (self.video_pad, v.per_group))),
                    }
                }
            }
        }
        let pads = enc
            .get_ids()
            .iter()
            .filter(|&&t| t == self.image_pad || t == self.video_pad)
            .count();
        if pads != runs.len() {
            return Err(TextError::Template(format!(
                "the text holds {pads} image or video pads where its {} media need {}",
                media.len(),
                runs.len()
            )));
        }
        let total: usize = enc.len() - pads + runs.iter().map(|r| r.1).sum::<usize>();
        let mut input_ids = Vec::with_capacity(total);
        let mut labels = Vec::with_capacity(total);
        // Each media's token range, from its text span.
        let mut media_tokens = vec![(usize::MAX, 0usize); media_spans.len()];
        let mut next_run = runs.iter();
        for (&id, &(s, e)) in enc.get_ids().iter().zip(enc.get_offsets()) {
            let at = input_ids.len();
            let n = if id == self.image_pad || id == self.video_pad {
                let &(expected, n) = next_run.next().expect("counted above");
                if id != expected {
                    return Err(TextError::Template(
                        "image and video pads came out in another order than their media".into(),
                    ));
                }
                input_ids.extend(std::iter::repeat_n(id as i64, n));
                labels.extend(std::iter::repeat_n(IGNORE_INDEX, n));
                n
            } else {
                input_ids.push(id as i64);
                let trained = spans.iter().any(|&(a, b)| s >= a && s < b);
                labels.push(if trained { id as i64 } else { IGNORE_INDEX });
                1
            };
            for (m, &(a, b)) in media_tokens.iter_mut().zip(&media_spans) {
                if s >= a && e <= b && e > s {
                    m.0 = m.0.min(at);
                    m.1 = m.1.max(at + n);
                }
            }
        }
        let kinds: Vec<Kind> = places.iter().map(|p| p.kind).collect();
        let mut tok = self.truncate(input_ids, labels, &media_tokens, &kinds)?;
        tok.text = text;
        Ok(tok)
    }

    /// Truncation policy: keep the first `max_length` tokens, but never cut inside an image's
    /// or a video's tokens — the cut moves before it and that media (and any later one) is
    /// dropped with its pixels. A sample left with no trained token fails.
    fn truncate(
        &self,
        mut ids: Vec<i64>,
        mut labels: Vec<i64>,
        media: &[(usize, usize)],
        kinds: &[Kind],
    ) -> Result<Tokenized, TextError> {
        let len = ids.len();
        let count = |kind: Kind, cut: usize| {
            media
                .iter()
                .zip(kinds)
                .filter(|(m, k)| **k == kind && m.1 <= cut)
                .count()
        };
        if len <= self.max_length {
            return Ok(Tokenized {
                input_ids: ids,
                labels,
                kept_images: count(Kind::Image, len),
                kept_videos: count(Kind::Video, len),
                truncated: false,
                text: String::new(),
            });
        }
        let mut cut = self.max_length;
        if let Some(&(start, _)) = media.iter().find(|&&(a, b)| a < cut && cut < b) {
            cut = start;
        }
        ids.truncate(cut);
        labels.truncate(cut);
        if labels.iter().all(|&l| l == IGNORE_INDEX) {
            return Err(TextError::TooLong {
                len,
                max: self.max_length,
            });
        }
        Ok(Tokenized {
            input_ids: ids,
            labels,
            kept_images: count(Kind::Image, cut),
            kept_videos: count(Kind::Video, cut),
            truncated: true,
            text: String::new(),
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Image,
    Video,
}

/// One image's or video's placeholder in rendered text.
struct Place {
    /// Its byte span, with the `<|vision_start|>` before and `<|vision_end|>` after when the
    /// template writes them (the Qwen templates do).
    span: (usize, usize),
    /// Where its pad token lies.
    pad: usize,
    kind: Kind,
}

/// Each image's and video's placeholder in rendered text, in order.
fn placeholders(text: &str) -> Vec<Place> {
    const START: &str = "<|vision_start|>";
    const END: &str = "<|vision_end|>";
    let mut out = Vec::new();
    for (pad, kind) in [
        ("<|image_pad|>", Kind::Image),
        ("<|video_pad|>", Kind::Video),
    ] {
        for (at, _) in text.match_indices(pad) {
            let start = match text[..at].ends_with(START) {
                true => at - START.len(),
                false => at,
            };
            let mut end = at + pad.len();
            if text[end..].starts_with(END) {
                end += END.len();
            }
            out.push(Place {
                span: (start, end),
                pad: at,
                kind,
            });
        }
    }
    out.sort_by_key(|p| p.pad);
    out
}

/// Python's `f"{t:.1f}"`: the exact binary value rounded to one decimal, ties to even.
fn one_decimal(t: f64) -> String {
    format!("{t:.1}")
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
