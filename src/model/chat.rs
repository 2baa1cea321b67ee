//! Chat templates: a model's `chat_template` (from its `tokenizer_config.json`) rendered
//! as Hugging Face transformers renders it, with the spans of assistant text.
//!
//! transformers compiles the template with Jinja2 (`trim_blocks`, `lstrip_blocks`, loop
//! controls), passes `messages`, `bos_token`, `eos_token` and `add_generation_prompt`, and
//! offers `raise_exception`, `strftime_now` and a `tojson` that writes Python's
//! `json.dumps` (no HTML escaping, `", "` and `": "` separators). minijinja with its
//! Python-compatible methods (`.strip()`, `.startswith()`, …) does the same here.
//!
//! Assistant spans, which the loss mask counts: a template that marks them with
//! `{% generation %}…{% endgeneration %}` (what `return_assistant_tokens_mask` reads)
//! gets exactly those. Any other template gets, for each assistant message, the text
//! that message adds after the prompt for it: `render(messages[..=i])` less
//! `render(messages[..i], add_generation_prompt)`, which includes the turn's end token
//! (`<|eot_id|>`, `<|im_end|>`, `</s>`), so the model learns to stop.

use minijinja::{Environment, Error, ErrorKind, Value};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Markers the renderer writes where `{% generation %}` blocks open and close.
const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("{path}: chat_template does not compile: {message}")]
    Compile { path: PathBuf, message: String },
    #[error("{0}")]
    Render(String),
}

/// A compiled chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// The template marks assistant text with `{% generation %}` blocks.
    marked: bool,
}

/// A rendered conversation and the byte ranges of its assistant text.
#[derive(Clone, Debug, PartialEq)]
pub struct Rendered {
    pub text: String,
    pub assistant: Vec<Range<usize>>,
}

/// A special token as `tokenizer_config.json` writes it: a string or an added-token
/// object with its `content`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    v.as_str()
        .map(str::to_string)
        .or_else(|| v["content"].as_str().map(str::to_string))
}

/// The directory of a tokenizer's files: `path` itself, or the one holding it.
fn tokenizer_dir(path: &Path) -> &Path {
    if path.is_dir() {
        path
    } else {
        path.parent().unwrap_or(Path::new("."))
    }
}

/// The bos and eos tokens a tokenizer_config.json names (empty where it does not).
fn special(config: &serde_json::Value) -> (String, String) {
    (
        token_text(&config["bos_token"]).unwrap_or_default(),
        token_text(&config["eos_token"]).unwrap_or_default(),
    )
}

impl ChatTemplate {
    /// The template of a model's tokenizer files: `path` is a tokenizer.json, the
    /// directory holding it, or a tokenizer_config.json; `None` when there is no
    /// template. Returns the file the template came from.
    pub fn beside(path: &Path) -> Result<Option<(ChatTemplate, PathBuf)>, ChatError> {
        // a tokenizer_config.json named as such, else the one in the tokenizer's directory,
        // where a chat_template.jinja (what transformers saves since 4.43) comes first
        let named = path.is_file()
            && path.extension().and_then(|e| e.to_str()) == Some("json")
            && path.file_name().and_then(|n| n.to_str()) != Some("tokenizer.json");
        let dir = tokenizer_dir(path);
        let config_path = if named {
            path.to_path_buf()
        } else {
            dir.join("tokenizer_config.json")
        };
        let read = |path: &Path, message: String| ChatError::Read {
            path: path.to_path_buf(),
            message,
        };
        let config: serde_json::Value = if config_path.exists() {
            let text =
                std::fs::read_to_string(&config_path).map_err(|e| read(&config_path, e.to_string()))?;
            serde_json::from_str(&text).map_err(|e| read(&config_path, format!("not JSON: {e}")))?
        } else {
            serde_json::Value::Null
        };
        let jinja = dir.join("chat_template.jinja");
        let (source, from) = if !named && jinja.is_file() {
            let source = std::fs::read_to_string(&jinja).map_err(|e| read(&jinja, e.to_string()))?;
            (source, jinja)
        } else {
            // a string, or named templates of which "default" is the chat one
            let source = match &config["chat_template"] {
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Array(named) => match named
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                {
                    Some(s) => s.to_string(),
                    None => return Ok(None),
                },
                _ => return Ok(None),
            };
            (source, config_path)
        };
        let (bos, eos) = special(&config);
        let template = ChatTemplate::new(&source, &bos, &eos).map_err(|message| ChatError::Compile {
            path: from.clone(),
            message,
        })?;
        Ok(Some((template, from)))
    }

    /// The bos and eos tokens of the tokenizer_config.json beside a tokenizer.json (empty
    /// where it does not say).
    pub fn special_tokens(tokenizer: &Path) -> (String, String) {
        let config: serde_json::Value =
            std::fs::read_to_string(tokenizer_dir(tokenizer).join("tokenizer_config.json"))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or_default();
        special(&config)
    }

    /// Compiles `source`; the error is minijinja's message with the line.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<ChatTemplate, String> {
        let (source, marked) = mark_generation(source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source)
            .map_err(|e| format!("{e:#}"))?;
        Ok(ChatTemplate {
            env,
            bos: bos.to_string(),
            eos: eos.to_string(),
            marked,
        })
    }

    pub fn bos(&self) -> &str {
        &self.bos
    }

    pub fn eos(&self) -> &str {
        &self.eos
    }

    /// The template's text for `messages` (each a JSON object with `role` and
    /// `content`), markers of generation blocks included.
    fn render_marked(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Render(e.to_string()))?;
        let context = minijinja::context! {
            messages => Value::from_serialize(messages),
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
            add_generation_prompt => add_generation_prompt,
        };
        template.render(context).map_err(|e| {
            // raise_exception's message is the template author's words: show them alone
            let message = match e.kind() {
                ErrorKind::InvalidOperation => e.detail().unwrap_or("").to_string(),
                _ => format!("{e:#}"),
            };
            ChatError::Render(format!("the chat template refused the messages: {message}"))
        })
    }

    /// The text for `messages`, as transformers' `apply_chat_template(…, tokenize=False)`.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        Ok(strip_markers(&self.render_marked(messages, add_generation_prompt)?).0)
    }

    /// The text for `messages` and its assistant spans (module docs).
    pub fn render_spans(&self, messages: &[serde_json::Value]) -> Result<Rendered, ChatError> {
        for m in messages {
            if m.to_string().contains([OPEN, CLOSE]) {
                return Err(ChatError::Render(
                    "a message contains U+E000 or U+E001, which mark generation blocks".into(),
                ));
            }
        }
        let (text, marked) = strip_markers(&self.render_marked(messages, false)?);
        if self.marked {
            return Ok(Rendered {
                text,
                assistant: marked,
            });
        }
        let mut assistant = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m["role"] != "assistant" {
                continue;
            }
            let prompt = self.render(&messages[..i], true)?;
            let upto = self.render(&messages[..=i], false)?;
            if !upto.starts_with(&prompt) || !text.starts_with(&upto) {
                return Err(ChatError::Render(format!(
                    "message {} (assistant): the template does not render a conversation as its \
                     prompt followed by the answer, so the answer's tokens cannot be found; mark \
                     assistant text with {{% generation %}}…{{% endgeneration %}} in the template, \
                     or set data.train_on_prompt: true",
                    i + 1
                )));
            }
            if upto.len() > prompt.len() {
                assistant.push(prompt.len()..upto.len());
            }
        }
        Ok(Rendered { text, assistant })
    }
}

/// Replaces `{% generation %}` / `{% endgeneration %}` (with their whitespace control)
/// by block tags that write the markers, so trimming works as around the originals.
fn mark_generation(source: &str) -> (String, bool) {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    let mut marked = false;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return (out, marked);
        };
        let mut inner = &tag[2..end];
        let left = control(inner.chars().next());
        inner = &inner[left.len()..];
        let right = control(inner.chars().next_back());
        let body = &inner[..inner.len() - right.len()];
        let marker = match body.trim() {
            "generation" => Some(OPEN),
            "endgeneration" => Some(CLOSE),
            _ => None,
        };
        match marker {
            Some(c) => {
                marked = true;
                out.push_str(&format!(
                    "{{%{left} if true %}}{{{{ \"\\u{:04x}\" }}}}{{% endif {right}%}}",
                    c as u32
                ));
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    (out, marked)
}

/// A tag's whitespace control character, if `c` is one.
fn control(c: Option<char>) -> &'static str {
    match c {
        Some('-') => "-",
        Some('+') => "+",
        _ => "",
    }
}

/// The text without markers, and the byte ranges between each open and close marker.
fn strip_markers(marked: &str) -> (String, Vec<Range<usize>>) {
    let mut text = String::with_capacity(marked.len());
    let mut spans = Vec::new();
    let mut open = None;
    for c in marked.chars() {
        match c {
            OPEN => open = Some(text.len()),
            CLOSE => {
                if let Some(start) = open.take() {
                    if text.len() > start {
                        spans.push(start..text.len());
                    }
                }
            }
            c => text.push(c),
        }
    }
    (text, spans)
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`, as transformers'
/// `tojson` filter writes it.
fn tojson(value: Value, indent: Option<usize>) -> Result<Value, Error> {
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                write_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `strftime_now(format)` for the codes chat templates use (`%d %b %Y`, …), in UTC.
fn strftime_now(format: &str) -> Result<String, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    Ok(strftime(format, secs))
}

fn strftime(format: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    // days since 1970-01-01 to a civil date (Howard Hinnant's algorithm)
    let days = secs.div_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let second = secs.rem_euclid(86_400);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{:02}", second / 3600)),
            Some('M') => out.push_str(&format!("{:02}", second / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", second % 60)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn generation_tags_keep_their_whitespace_control() {
        let (s, marked) = mark_generation("a {%- generation -%} b {% endgeneration %}c{% if x %}");
        assert!(marked);
        assert_eq!(
            s,
            "a {%- if true %}{{ \"\\ue000\" }}{% endif -%} b {% if true %}{{ \"\\ue001\" }}{% endif %}c{% if x %}"
        );
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        let messages = [
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "yo"}),
        ];
        let r = t.render_spans(&messages).unwrap();
        // trim_blocks takes the newline after a block tag, as Jinja2 does
        assert_eq!(r.text, "user: hiassistant: yo");
        assert_eq!(&r.text[r.assistant[0].clone()], "yo");
    }

    #[test]
    fn dates_and_json_are_written_as_python_writes_them() {
        // 2024-07-26 12:34:56 UTC
        assert_eq!(
            strftime("%d %b %Y %H:%M:%S %B", 1_721_997_296),
            "26 Jul 2024 12:34:56 July"
        );
        let v = Value::from_serialize(json!({"name": "f", "args": [1, "<é>"]}));
        assert_eq!(
            tojson(v.clone(), None).unwrap().to_string(),
            r#"{"name": "f", "args": [1, "<é>"]}"#
        );
        assert_eq!(
            tojson(v, Some(2)).unwrap().to_string(),
            "{\n  \"name\": \"f\",\n  \"args\": [\n    1,\n    \"<é>\"\n  ]\n}"
        );
    }
}
