//! DeepSpeed's monitors: TensorBoard event files and per-scalar CSV files, laid out and
//! named as DeepSpeed writes them (`<output_path>/<job_name>/`, `Train/Samples/train_loss`
//! indexed by samples seen), so a DeepSpeed user's dashboard keeps working.
//!
//! The event file is TFRecord: per record its length (u64), the masked CRC-32C of the
//! length, the bytes of one protobuf `Event`, their masked CRC-32C. An `Event` here holds
//! wall time, step and either the file version or a `Summary` of one `simple_value`;
//! the few protobuf fields are encoded by hand (no crate writes them without a protobuf
//! code generator). Written from node 0 only; flushed every `steps_per_print` steps and
//! when the monitor is dropped, so a killed run keeps what was flushed.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// One scalar at one point of the run.
pub struct Scalar {
    pub tag: String,
    pub value: f64,
}

/// The scalar's TensorBoard tag as a file name, as DeepSpeed's csvMonitor makes it.
fn csv_name(tag: &str) -> String {
    format!("{}.csv", tag.replace(['/', ' '], "_"))
}

/// Writes scalars to the monitors a config enables.
pub struct Monitors {
    tensorboard: Option<EventWriter>,
    csv: Option<CsvWriter>,
    flush_every: u64,
    written: u64,
}

impl Monitors {
    /// Monitors writing into these directories (created); None for each one off. An
    /// error names the directory it could not write.
    pub fn open(
        tensorboard: Option<&Path>,
        csv: Option<&Path>,
        flush_every: u64,
    ) -> Result<Monitors, (PathBuf, std::io::Error)> {
        Ok(Monitors {
            tensorboard: tensorboard
                .map(|d| EventWriter::create(d).map_err(|e| (d.to_path_buf(), e)))
                .transpose()?,
            csv: csv
                .map(|d| CsvWriter::create(d).map_err(|e| (d.to_path_buf(), e)))
                .transpose()?,
            flush_every: flush_every.max(1),
            written: 0,
        })
    }

    /// Records one step's scalars at `samples`; flushes every `flush_every` calls.
    pub fn record(&mut self, samples: u64, scalars: &[Scalar]) -> std::io::Result<()> {
        if let Some(tb) = self.tensorboard.as_mut() {
            for s in scalars {
                tb.scalar(&s.tag, s.value as f32, samples)?;
            }
        }
        if let Some(csv) = self.csv.as_mut() {
            for s in scalars {
                csv.scalar(&s.tag, s.value, samples)?;
            }
        }
        self.written += 1;
        if self.written.is_multiple_of(self.flush_every) {
            self.flush()?;
        }
        Ok(())
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.out.flush()?;
        }
        if let Some(csv) = self.csv.as_mut() {
            for (_, file) in &mut csv.files {
                file.flush()?;
            }
        }
        Ok(())
    }
}

impl Drop for Monitors {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            tracing::warn!("flushing the monitors: {e}");
        }
    }
}

/// A TensorBoard event file.
struct EventWriter {
    out: BufWriter<File>,
}

impl EventWriter {
    fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let host =
            std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "localhost".into());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let name = format!(
            "events.out.tfevents.{}.{}.{}",
            now.as_secs(),
            host.trim(),
            std::process::id()
        );
        let mut writer = EventWriter {
            out: BufWriter::new(File::create(dir.join(name))?),
        };
        let mut event = Vec::new();
        event_header(&mut event, 0);
        bytes_field(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        writer.out.flush()?;
        Ok(writer)
    }

    fn scalar(&mut self, tag: &str, value: f32, step: u64) -> std::io::Result<()> {
        let mut value_msg = Vec::new();
        bytes_field(&mut value_msg, 1, tag.as_bytes());
        value_msg.push(2 << 3 | 5); // simple_value: fixed32
        value_msg.extend_from_slice(&value.to_le_bytes());
        let mut summary = Vec::new();
        bytes_field(&mut summary, 1, &value_msg);
        let mut event = Vec::new();
        event_header(&mut event, step);
        bytes_field(&mut event, 5, &summary);
        self.record(&event)
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())
    }
}

/// `wall_time` (field 1, double) and `step` (field 2, int64) of an `Event`.
fn event_header(out: &mut Vec<u8>, step: u64) {
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    out.push(1 << 3 | 1);
    out.extend_from_slice(&wall.to_le_bytes());
    out.push(2 << 3);
    varint(out, step);
}

/// A length-delimited protobuf field.
fn bytes_field(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push(field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// TFRecord's masked CRC-32C.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One CSV file per scalar: a `step,<last tag segment>` header, then one row per record.
struct CsvWriter {
    dir: PathBuf,
    files: Vec<(String, BufWriter<File>)>,
}

impl CsvWriter {
    fn create(dir: &Path) -> std::io::Result<CsvWriter> {
        std::fs::create_dir_all(dir)?;
        Ok(CsvWriter {
            dir: dir.to_path_buf(),
            files: Vec::new(),
        })
    }

    fn scalar(&mut self, tag: &str, value: f64, step: u64) -> std::io::Result<()> {
        let index = match self.files.iter().position(|(t, _)| t == tag) {
            Some(i) => i,
            None => {
                let path = self.dir.join(csv_name(tag));
                let fresh = !path.exists();
                let file = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)?;
                let mut file = BufWriter::new(file);
                if fresh {
                    let header = tag.rsplit('/').next().unwrap_or(tag);
                    writeln!(file, "step,{header}")?;
                }
                self.files.push((tag.to_string(), file));
                self.files.len() - 1
            }
        };
        writeln!(self.files[index].1, "{step},{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_masked_crc_is_tfrecords() {
        // CRC-32C of "123456789" is 0xe3069283 (the standard check value); masking
        // rotates it right by 15 bits and adds 0xa282ead8
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(
            masked_crc(b"123456789"),
            0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn varints_are_little_endian_groups_of_seven_bits() {
        let mut out = Vec::new();
        varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
    }

    #[test]
    fn csv_names_follow_deepspeed() {
        assert_eq!(
            csv_name("Train/Samples/train_loss"),
            "Train_Samples_train_loss.csv"
        );
    }
}
