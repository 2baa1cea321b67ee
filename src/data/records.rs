//! Records of fine-tuning data sets, as the Hugging Face ecosystem writes them: one JSON
//! object per line of a `.jsonl` file, or one row of a `.parquet` file (what `datasets`
//! saves and the Hub serves; read with the Apache Arrow project's `parquet` crate, each
//! row as the JSON object its columns make). A directory of such files is one data set,
//! read in name order. The kind is detected per record:
//!
//! - `{"text": …}`: a document, every token trained;
//! - `{"prompt": …, "completion": …}`: strings, or lists of chat messages (TRL's
//!   conversational prompt-completion); only the completion is trained;
//! - `{"messages": [{"role", "content"}, …]}`: a conversation (TRL, Axolotl and OpenAI's
//!   fine-tuning files); only assistant turns are trained.

use super::DataError;
use serde_json::Value;
use std::io::BufRead;
use std::path::{Path, PathBuf};

/// One record of a data set.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    Text(String),
    Prompt { prompt: Value, completion: Value },
    Messages(Vec<Value>),
}

impl Record {
    /// The record a JSON object is, or what is wrong with it (naming the field).
    pub fn parse(value: Value) -> Result<Record, String> {
        let Value::Object(mut map) = value else {
            return Err("not a JSON object".into());
        };
        if let Some(messages) = map.remove("messages") {
            return messages_of("messages", messages).map(Record::Messages);
        }
        if let (Some(prompt), Some(completion)) = (map.remove("prompt"), map.remove("completion")) {
            return match (prompt, completion) {
                (Value::String(p), Value::String(c)) => Ok(Record::Prompt {
                    prompt: Value::String(p),
                    completion: Value::String(c),
                }),
                (p @ Value::Array(_), c @ Value::Array(_)) => Ok(Record::Prompt {
                    prompt: Value::Array(messages_of("prompt", p)?),
                    completion: Value::Array(messages_of("completion", c)?),
                }),
                _ => Err(
                    "fields \"prompt\" and \"completion\" must both be strings or both lists of messages"
                        .into(),
                ),
            };
        }
        match map.remove("text") {
            Some(Value::String(t)) => Ok(Record::Text(t)),
            Some(_) => Err("field \"text\" is not a string".into()),
            None => {
                let keys: Vec<&str> = map.keys().map(String::as_str).collect();
                Err(format!(
                    "has none of the fields \"text\", \"prompt\" + \"completion\" or \"messages\" (it has {keys:?})"
                ))
            }
        }
    }
}

/// A list of chat messages, each an object with a string `role` and a string (or null,
/// for tool calls) `content`.
fn messages_of(field: &str, value: Value) -> Result<Vec<Value>, String> {
    let Value::Array(messages) = value else {
        return Err(format!("field {field:?} is not a list of messages"));
    };
    for (i, m) in messages.iter().enumerate() {
        if !m["role"].is_string() {
            return Err(format!("{field}[{i}] has no string \"role\""));
        }
        if !(m["content"].is_string() || m["content"].is_null() || m["content"].is_array()) {
            return Err(format!("{field}[{i}].content is not a string"));
        }
    }
    if messages.is_empty() {
        return Err(format!("field {field:?} is an empty list"));
    }
    Ok(messages)
}

/// Extensions of record files.
const EXTENSIONS: [&str; 2] = ["jsonl", "parquet"];

fn is_records(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.contains(&e))
}

/// The record files of a data set: the file itself, or a directory's, in name order.
pub fn files(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let read = |source| DataError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(read)? {
        let p = entry.map_err(read)?.path();
        if is_records(&p) {
            files.push(p);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(DataError::Invalid {
            path: path.to_path_buf(),
            message: "the directory has no .jsonl or .parquet files".into(),
        });
    }
    Ok(files)
}

/// Calls `each` with every record of `files` in order; an error names the file and
/// line (or row).
pub fn for_each(
    files: &[PathBuf],
    mut each: impl FnMut(Record) -> Result<(), String>,
) -> Result<(), DataError> {
    for file in files {
        if file.extension().and_then(|e| e.to_str()) == Some("parquet") {
            parquet_rows(file, &mut each)?;
        } else {
            jsonl_lines(file, &mut each)?;
        }
    }
    Ok(())
}

fn jsonl_lines(file: &Path, each: &mut impl FnMut(Record) -> Result<(), String>) -> Result<(), DataError> {
    let read = |source| DataError::Read {
        path: file.to_path_buf(),
        source,
    };
    let f = std::fs::File::open(file).map_err(read)?;
    for (number, line) in std::io::BufReader::new(f).lines().enumerate() {
        let invalid = |message: String| DataError::Invalid {
            path: file.to_path_buf(),
            message: format!("line {}: {message}", number + 1),
        };
        let line = line.map_err(read)?;
        if line.trim().is_empty() {
            continue;
        }
        let value = serde_json::from_str(&line).map_err(|e| invalid(format!("not JSON: {e}")))?;
        each(Record::parse(value).map_err(invalid)?).map_err(invalid)?;
    }
    Ok(())
}

fn parquet_rows(file: &Path, each: &mut impl FnMut(Record) -> Result<(), String>) -> Result<(), DataError> {
    use parquet::file::reader::SerializedFileReader;
    let invalid = |message: String| DataError::Invalid {
        path: file.to_path_buf(),
        message,
    };
    let f = std::fs::File::open(file).map_err(|source| DataError::Read {
        path: file.to_path_buf(),
        source,
    })?;
    let reader =
        SerializedFileReader::new(f).map_err(|e| invalid(format!("not a readable Parquet file: {e}")))?;
    for (number, row) in reader.into_iter().enumerate() {
        let at = |message: String| invalid(format!("row {}: {message}", number + 1));
        let row = row.map_err(|e| at(e.to_string()))?;
        each(Record::parse(row.to_json_value()).map_err(at)?).map_err(at)?;
    }
    Ok(())
}

/// Whether the data set's first record is a chat or prompt/completion record (a data
/// set of `{"text"}` records only is a stream of documents, as plain text is).
pub fn first_is_text(files: &[PathBuf]) -> Result<bool, DataError> {
    let mut first = None;
    let stop = "first record read";
    let result = for_each(files, |record| {
        first = Some(matches!(record, Record::Text(_)));
        Err(stop.into())
    });
    match (first, result) {
        (Some(text), _) => Ok(text),
        (None, Err(e)) => Err(e),
        (None, Ok(())) => Err(DataError::Invalid {
            path: files.first().cloned().unwrap_or_default(),
            message: "no records".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn records_are_told_apart_and_bad_ones_named() {
        assert_eq!(Record::parse(json!({"text": "a"})), Ok(Record::Text("a".into())));
        assert!(matches!(
            Record::parse(json!({"prompt": "q", "completion": "a", "id": 3})),
            Ok(Record::Prompt { .. })
        ));
        assert!(matches!(
            Record::parse(json!({"messages": [{"role": "user", "content": "hi"}]})),
            Ok(Record::Messages(_))
        ));
        let e = Record::parse(json!({"question": "q"})).unwrap_err();
        assert!(e.contains("none of the fields") && e.contains("question"), "{e}");
        let e = Record::parse(json!({"messages": [{"role": "user", "content": 3}]})).unwrap_err();
        assert_eq!(e, "messages[0].content is not a string");
        let e = Record::parse(json!({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}))
            .unwrap_err();
        assert!(e.contains("both be strings"), "{e}");
    }
}
