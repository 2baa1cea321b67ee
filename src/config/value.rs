//! Leaf values of a ds_config as users write them: `5e8`, `"5e8"`, `500000000` and
//! `"auto"` for numbers; `true`, `false` and `"auto"` for switches.
//!
//! DeepSpeed configs written by hand and by the Hugging Face integration mix all of these
//! spellings, so the serde mirror accepts each and the plan resolves them with the
//! readers at the end ([`number`], [`count`], [`positive`], [`count_or_auto`]), whose
//! errors name the key.

use super::ConfigError;
use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use std::fmt;

/// A number, or `"auto"` to be resolved from the model or device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Num {
    Value(f64),
    Auto,
}

impl Num {
    pub fn value(self) -> Option<f64> {
        match self {
            Num::Value(v) => Some(v),
            Num::Auto => None,
        }
    }
}

impl<'de> Deserialize<'de> for Num {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct NumVisitor;
        impl Visitor<'_> for NumVisitor {
            type Value = Num;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number (like 5e8 or \"5e8\") or \"auto\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Num, E> {
                Ok(Num::Value(v as f64))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Num, E> {
                Ok(Num::Value(v as f64))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Num, E> {
                Ok(Num::Value(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Num, E> {
                let trimmed = v.trim();
                if trimmed.eq_ignore_ascii_case("auto") {
                    return Ok(Num::Auto);
                }
                trimmed
                    .replace('_', "")
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite())
                    .map(Num::Value)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }
        d.deserialize_any(NumVisitor)
    }
}

impl Serialize for Num {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Num::Value(v) if v.fract() == 0.0 && v.abs() < 9.0e15 => s.serialize_i64(*v as i64),
            Num::Value(v) => s.serialize_f64(*v),
            Num::Auto => s.serialize_str("auto"),
        }
    }
}

/// A switch, or `"auto"` to be resolved from the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flag {
    Value(bool),
    Auto,
}

impl<'de> Deserialize<'de> for Flag {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct FlagVisitor;
        impl Visitor<'_> for FlagVisitor {
            type Value = Flag;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("true, false or \"auto\"")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Flag, E> {
                Ok(Flag::Value(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Flag, E> {
                match v.trim().to_ascii_lowercase().as_str() {
                    "auto" => Ok(Flag::Auto),
                    "true" => Ok(Flag::Value(true)),
                    "false" => Ok(Flag::Value(false)),
                    _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
                }
            }
        }
        d.deserialize_any(FlagVisitor)
    }
}

impl Serialize for Flag {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Flag::Value(v) => s.serialize_bool(*v),
            Flag::Auto => s.serialize_str("auto"),
        }
    }
}

/// Reads a number field: `"auto"` is refused here (callers that can resolve it check
/// for `Num::Auto` first).
pub fn number(key: &str, value: Option<Num>, default: f64) -> Result<f64, ConfigError> {
    match value {
        None => Ok(default),
        Some(Num::Value(v)) => Ok(v),
        Some(Num::Auto) => Err(ConfigError::invalid(
            key,
            "\"auto\" cannot be resolved here",
            format!("give a value, e.g. --set {key}={default}"),
        )),
    }
}

/// Reads a non-negative integer field (`5e8` is fine, `2.5` is not).
pub fn count(key: &str, value: Option<Num>, default: usize) -> Result<usize, ConfigError> {
    let v = number(key, value, default as f64)?;
    if v < 0.0 || v.fract() != 0.0 || v > 9.0e18 {
        return Err(ConfigError::invalid(
            key,
            format!("{v} is not a non-negative integer"),
            format!("write a whole number, e.g. {default}"),
        ));
    }
    Ok(v as usize)
}

/// Like [`count`], and refuses 0.
pub fn positive(key: &str, value: Option<Num>, default: usize) -> Result<usize, ConfigError> {
    let v = count(key, value, default)?;
    if v == 0 {
        return Err(ConfigError::invalid(
            key,
            "must be positive",
            format!("use at least 1 (default {default})"),
        ));
    }
    Ok(v)
}

/// Reads an `"auto"`-able number: `auto` gives `resolved`.
pub fn count_or_auto(
    key: &str,
    value: Option<Num>,
    default: usize,
    resolved: usize,
) -> Result<usize, ConfigError> {
    match value {
        Some(Num::Auto) => Ok(resolved),
        other => count(key, other, default),
    }
}
