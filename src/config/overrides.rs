//! `--set key.path=value` overrides, applied to the JSON before it is parsed, so an
//! override is checked exactly like the same key written in the file.

use super::ConfigError;
use serde_json::{Map, Value};

/// Applies one `a.b.c=value` override. The value is read as JSON when it parses
/// (`3`, `5e8`, `true`, `[0.9,0.95]`, `"x"`), otherwise as a string (`cpu`, `/mnt/nvme`).
pub fn apply(root: &mut Value, arg: &str) -> Result<(), ConfigError> {
    let fail = |message: &str| ConfigError::Set {
        arg: arg.to_string(),
        message: message.to_string(),
    };
    let (path, raw) = arg
        .split_once('=')
        .ok_or_else(|| fail("expected KEY=VALUE, e.g. --set train.steps=20"))?;
    let path = path.trim();
    if path.is_empty() || path.split('.').any(str::is_empty) {
        return Err(fail("the key is empty or has an empty segment"));
    }
    let value = serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()));
    let mut node = root;
    let segments: Vec<&str> = path.split('.').collect();
    for (i, segment) in segments.iter().enumerate() {
        let Some(object) = node.as_object_mut() else {
            let parent = segments[..i].join(".");
            return Err(fail(&format!(
                "`{parent}` is not an object, so it has no key `{segment}`"
            )));
        };
        if i + 1 == segments.len() {
            object.insert(segment.to_string(), value);
            return Ok(());
        }
        node = object
            .entry(segment.to_string())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn sets_nested_keys_and_parses_json_values() {
        let mut v = json!({"train": {"steps": 5}});
        apply(&mut v, "train.steps=20").unwrap();
        apply(&mut v, "zero_optimization.offload_optimizer.device=nvme").unwrap();
        apply(&mut v, "optimizer.params.betas=[0.9,0.95]").unwrap();
        apply(&mut v, "reduce=5e8").unwrap();
        assert_eq!(v["train"]["steps"], json!(20));
        assert_eq!(
            v["zero_optimization"]["offload_optimizer"]["device"],
            json!("nvme")
        );
        assert_eq!(v["optimizer"]["params"]["betas"], json!([0.9, 0.95]));
        assert_eq!(v["reduce"], json!(5e8));
    }

    #[test]
    fn rejects_malformed_overrides() {
        let mut v = json!({"train": 3});
        assert!(apply(&mut v, "train.steps").is_err());
        assert!(apply(&mut v, "train.steps=1")
            .unwrap_err()
            .to_string()
            .contains("not an object"));
        assert!(apply(&mut v, "a..b=1").is_err());
    }
}
