//! Records to token ids and the mask of tokens the loss counts, as TRL's `SFTTrainer`
//! prepares them:
//!
//! - text: the text and the end-of-sequence token, tokenized with the tokenizer's
//!   special tokens (a Llama tokenizer's BOS); every token counts;
//! - prompt + completion (strings): the prompt, and the prompt + completion + EOS, each
//!   tokenized so; the tokens past the prompt's count (`completion_only_loss`);
//! - prompt + completion (messages): the prompt templated with the generation prompt,
//!   and the whole conversation templated; the tokens past the prompt's count;
//! - messages: the conversation templated (`model::chat`); tokens that overlap an
//!   assistant span count (`assistant_only_loss`).
//!
//! Templated text is tokenized without added special tokens (the template writes them),
//! as `apply_chat_template` does. `train_on_prompt` counts every token.

use crate::model::chat::ChatTemplate;
use std::ops::Range;
use tokenizers::Tokenizer;

use super::records::Record;

/// End-of-text tokens by which tokenizers are known to end a document.
pub const EOS_CANDIDATES: &[&str] = &["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

/// Token ids of one sample and whether each counts as a target.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub counted: Vec<bool>,
}

pub struct Encoder {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// What to say when chat records meet a model without a template.
    no_template: String,
    eos: String,
    train_on_prompt: bool,
}

impl Encoder {
    /// `no_template`: the error for chat records without a template (naming the file
    /// and the fix).
    pub fn new(
        tokenizer: Tokenizer,
        template: Option<ChatTemplate>,
        no_template: String,
        train_on_prompt: bool,
    ) -> Encoder {
        let eos = template
            .as_ref()
            .map(|t| t.eos().to_string())
            .filter(|e| !e.is_empty())
            .or_else(|| {
                EOS_CANDIDATES
                    .iter()
                    .find(|t| tokenizer.token_to_id(t).is_some())
                    .map(|t| t.to_string())
            })
            .unwrap_or_default();
        Encoder {
            tokenizer,
            template,
            no_template,
            eos,
            train_on_prompt,
        }
    }

    fn tokens(&self, text: &str, special: bool) -> Result<tokenizers::Encoding, String> {
        self.tokenizer
            .encode(text, special)
            .map_err(|e| format!("cannot tokenize: {e}"))
    }

    fn template(&self) -> Result<&ChatTemplate, String> {
        self.template.as_ref().ok_or_else(|| self.no_template.clone())
    }

    /// `text` with the end-of-sequence token, unless it already ends with it.
    fn ended(&self, text: String) -> String {
        if self.eos.is_empty() || text.ends_with(&self.eos) {
            text
        } else {
            text + &self.eos
        }
    }

    /// The sample of one record.
    pub fn encode(&self, record: &Record) -> Result<Encoded, String> {
        let (ids, counted) = match record {
            Record::Text(text) => {
                let ids = self.tokens(&self.ended(text.clone()), true)?.get_ids().to_vec();
                let counted = vec![true; ids.len()];
                (ids, counted)
            }
            Record::Prompt {
                prompt: serde_json::Value::String(p),
                completion: serde_json::Value::String(c),
            } => {
                let prompt = self.tokens(p, true)?.len();
                let ids = self
                    .tokens(&self.ended(format!("{p}{c}")), true)?
                    .get_ids()
                    .to_vec();
                let counted = (0..ids.len()).map(|j| j >= prompt).collect();
                (ids, counted)
            }
            Record::Prompt { prompt, completion } => {
                let template = self.template()?;
                let (p, c) = (as_list(prompt), as_list(completion));
                let prompt_text = template.render(p, true).map_err(|e| e.to_string())?;
                let whole: Vec<serde_json::Value> = p.iter().chain(c).cloned().collect();
                let text = template.render(&whole, false).map_err(|e| e.to_string())?;
                let prompt = self.tokens(&prompt_text, false)?.len();
                let ids = self.tokens(&text, false)?.get_ids().to_vec();
                let counted = (0..ids.len()).map(|j| j >= prompt).collect();
                (ids, counted)
            }
            Record::Messages(messages) => {
                let rendered = self
                    .template()?
                    .render_spans(messages)
                    .map_err(|e| e.to_string())?;
                let encoding = self.tokens(&rendered.text, false)?;
                let counted = encoding
                    .get_offsets()
                    .iter()
                    .map(|&(start, end)| overlaps(&rendered.assistant, start..end))
                    .collect();
                (encoding.get_ids().to_vec(), counted)
            }
        };
        let counted = if self.train_on_prompt {
            vec![true; ids.len()]
        } else {
            counted
        };
        Ok(Encoded { ids, counted })
    }
}

fn as_list(v: &serde_json::Value) -> &[serde_json::Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

/// Whether a token's byte range meets any span (transformers marks every token from
/// the one holding a span's first character to the one holding its last).
fn overlaps(spans: &[Range<usize>], token: Range<usize>) -> bool {
    spans.iter().any(|s| token.start < s.end && s.start < token.end)
}
