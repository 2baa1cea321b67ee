//! Configuration errors. Each names the file or key and says how to fix it; the CLI
//! exits with status 2 on any of them, having written nothing.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config file {path} is not valid JSON: {message} (line {line}, column {column})")]
    Json {
        path: PathBuf,
        message: String,
        line: usize,
        column: usize,
    },
    #[error("--set {arg}: {message}")]
    Set { arg: String, message: String },
    #[error("config key `{key}`: {message}")]
    Type { key: String, message: String },
    #[error("unknown config key `{key}`{}", suggestion.as_ref().map(|s| format!("; did you mean `{s}`?")).unwrap_or_default())]
    UnknownKey { key: String, suggestion: Option<String> },
    #[error("config key `{key}`: {message}; fix: {fix}")]
    Invalid {
        key: String,
        message: String,
        fix: String,
    },
    #[error("model: {0}")]
    Model(String),
}

impl ConfigError {
    pub fn invalid(key: impl Into<String>, message: impl Into<String>, fix: impl Into<String>) -> Self {
        ConfigError::Invalid {
            key: key.into(),
            message: message.into(),
            fix: fix.into(),
        }
    }
}
