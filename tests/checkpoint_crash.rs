//! Crash safety at every step of a save: the process is killed (SIGKILL) just before
//! each operation of the save/commit sequence in turn and the last good checkpoint must
//! load and resume every time; and the file-system system calls of real saves, traced
//! from outside the process by strace, must make every write durable (fsync of the file,
//! then of its directory) before the rename that publishes it.

use crate::checkpoint_process::{check_all, leftovers, tierzero, write_config};
use serde_json::json;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use tierzero::checkpoint::crash;
use tierzero::checkpoint::save;

/// Copies a directory tree.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

/// Runs `tierzero train` in `dir` resuming from `resume` up to `steps`, with `crash`
/// set; returns how it ended and its stderr.
fn train_process(
    dir: &Path,
    resume: Option<&str>,
    steps: u64,
    crash: Option<&str>,
    no_exchange: bool,
) -> (std::process::ExitStatus, String) {
    let log = dir.join("log.txt");
    let mut command = tierzero();
    command.arg("train").arg("-c").arg(dir.join("config.json"));
    if let Some(resume) = resume {
        command.args(["--resume", resume]);
    }
    command
        .args(["--set", &format!("train.steps={steps}")])
        .args(["--set", "train.keep_last=2"])
        .env_remove(crash::VAR)
        .env("TIERZERO_CRASH_NO_EXCHANGE", if no_exchange { "1" } else { "0" })
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    if let Some(crash) = crash {
        command.env(crash::VAR, crash);
    }
    let status = command.status().unwrap();
    (status, std::fs::read_to_string(&log).unwrap_or_default())
}

/// `dir/config.json` for the crash cases (a tiny Llama over 2 ranks, the optimizer on
/// NVMe, a checkpoint every step).
fn write_case_config(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let model = json!({ "preset": "llama-tiny", "hidden_size": 64, "num_hidden_layers": 2 });
    write_config(dir, model, 2);
}

/// One crash case: `scenario` "next" saves step 3 after steps 1 and 2 (a new step,
/// pruning step 1 with keep_last 2); "again" resumes from step 1 and saves step 2 a
/// second time (the exchange); "aside" does the same as a file system without
/// `RENAME_EXCHANGE` would (two renames, the old copy moved aside first). Returns
/// whether the kill landed.
fn crash_case(base: &Path, dir: &Path, scenario: &str, crash: &str) -> bool {
    write_case_config(dir);
    copy_tree(&base.join("out"), &dir.join("out"));
    let root = save::root(&dir.join("out"));
    let (resume, steps, saved) = match scenario {
        "next" => ("latest".to_string(), 3, 3),
        _ => (root.join("step-1").display().to_string(), 2, 2),
    };
    let (status, log) = train_process(dir, Some(&resume), steps, Some(crash), scenario == "aside");
    let killed = status.signal() == Some(libc::SIGKILL);
    assert!(
        killed || status.success(),
        "{scenario} {crash}: neither killed nor finished ({status}): {log}"
    );
    // the last good checkpoint is whole and `latest` names step 2 or the new one
    let latest = check_all(&root).unwrap_or_else(|| panic!("{scenario} {crash}: no latest"));
    let published = crash::POINTS
        .iter()
        .position(|p| crash.starts_with(&format!("{p}@")))
        > crash::POINTS.iter().position(|p| *p == "latest-rename");
    let expected = if published || !killed { saved } else { 2 };
    assert_eq!(latest, expected, "{scenario} {crash}: latest");
    // it resumes and the next save cleans up after the crash
    let (status, log) = train_process(dir, Some("latest"), 4, None, scenario == "aside");
    assert!(status.success(), "{scenario} {crash}: resume failed: {log}");
    assert_eq!(check_all(&root), Some(4), "{scenario} {crash}");
    assert_eq!(leftovers(&root), Vec::<String>::new(), "{scenario} {crash}");
    let kept: Vec<u64> = save::list(&root).iter().map(|(s, _)| *s).collect();
    assert_eq!(kept, vec![3, 4], "{scenario} {crash}: keep_last 2");
    killed
}

#[test]
fn a_kill_at_every_step_of_a_save_keeps_the_last_good_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    write_case_config(&base);
    let (status, log) = train_process(&base, None, 2, None, false);
    assert!(status.success(), "{log}");
    let mut cases: Vec<(&str, String)> = Vec::new();
    let commit = crash::POINTS.iter().position(|p| *p == "manifest-write").unwrap();
    for (i, point) in crash::POINTS.iter().enumerate() {
        cases.push(("next", format!("{point}@3")));
        cases.push(("again", format!("{point}@2")));
        if i >= commit {
            cases.push(("aside", format!("{point}@2")));
        }
    }
    // points a save reaches many times: also a later hit
    for crash in ["stage-file@3:3", "slice-write@3:7", "slice-sync@3:4"] {
        cases.push(("next", crash.to_string()));
    }
    let mut killed: Vec<String> = Vec::new();
    for (i, (scenario, crash)) in cases.iter().enumerate() {
        let dir = tmp.path().join(format!("case-{i}"));
        if crash_case(&base, &dir, scenario, crash) {
            killed.push(crash.split('@').next().unwrap().to_string());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    let missed: Vec<&&str> = crash::POINTS
        .iter()
        .filter(|p| !killed.iter().any(|k| k == *p))
        .collect();
    assert!(missed.is_empty(), "no save reached {missed:?}");
    println!(
        "{} crash cases, {} killed at their point",
        cases.len(),
        killed.len()
    );
}

/// A file-system operation of a save, as strace saw the process make it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    /// A file opened with `O_CREAT`, or a directory made.
    Create(PathBuf),
    /// A write or truncation of a file.
    Write(PathBuf),
    /// fsync/fdatasync of a file.
    Sync(PathBuf),
    /// fsync of a directory.
    SyncDir(PathBuf),
    Rename(PathBuf, PathBuf),
    Exchange(PathBuf, PathBuf),
    /// A directory removed.
    Remove(PathBuf),
}

impl Op {
    /// The path the operation acts on (the source of a rename).
    fn path(&self) -> &Path {
        match self {
            Op::Create(p) | Op::Write(p) | Op::Sync(p) | Op::SyncDir(p) | Op::Remove(p) => p,
            Op::Rename(p, _) | Op::Exchange(p, _) => p,
        }
    }
}

/// The system calls a save can make durable or publish state with.
const TRACED: &str = "trace=openat,creat,mkdir,mkdirat,write,pwrite64,writev,pwritev,pwritev2,ftruncate,fallocate,fsync,fdatasync,rename,renameat,renameat2,rmdir,unlinkat";

/// Runs `tierzero train` on `config` under strace (every thread, paths of descriptors
/// shown), with `args`; returns the traced lines.
fn traced_train(config: &Path, args: &[&str], trace: &Path) -> Vec<String> {
    let status = std::process::Command::new("strace")
        .args([
            "-f",
            "-qq",
            "-y",
            "-s",
            "0",
            "-e",
            TRACED,
            "-e",
            "signal=none",
            "-o",
        ])
        .arg(trace)
        .arg(env!("CARGO_BIN_EXE_tierzero"))
        .arg("train")
        .arg("-c")
        .arg(config)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("strace runs (make setup installs it)");
    assert!(status.success(), "tierzero train {args:?} under strace: {status}");
    std::fs::read_to_string(trace)
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

/// The quoted strings of a traced call's arguments, in order.
fn quoted(args: &str) -> Vec<String> {
    args.split('"').skip(1).step_by(2).map(String::from).collect()
}

/// The paths strace shows in angle brackets after descriptors (`-y`), in order.
fn fd_paths(text: &str) -> Vec<PathBuf> {
    text.split('<')
        .skip(1)
        .filter_map(|s| s.split_once('>').map(|(p, _)| PathBuf::from(p)))
        .collect()
}

/// A traced call's arguments and result: split at the first `)` followed by spaces and
/// `= ` (strace pads resumed calls; data strings are empty with `-s 0`).
fn split_result(call: &str) -> Option<(&str, &str)> {
    call.match_indices(')').find_map(|(i, _)| {
        let result = call[i + 1..].trim_start().strip_prefix("= ")?;
        Some((&call[..i], result))
    })
}

/// The successful file-system operations of strace's output, in the order they
/// completed (a call another thread interrupted counts where strace saw it resume).
fn parse_trace(lines: &[String]) -> Vec<Op> {
    let mut pending: std::collections::HashMap<String, String> = Default::default();
    let mut calls: Vec<String> = Vec::new();
    for line in lines {
        let (pid, rest) = line.split_once(' ').unwrap_or(("", line));
        let rest = rest.trim_start();
        if let Some(head) = rest.strip_suffix(" <unfinished ...>") {
            pending.insert(pid.to_string(), head.to_string());
        } else if rest.starts_with("<... ") {
            // `<... fsync resumed>)      = 0`: the rest of the arguments, padding, result
            let tail = rest.split_once("resumed>").map_or("", |(_, t)| t);
            calls.push(pending.remove(pid).unwrap_or_default() + tail);
        } else {
            calls.push(rest.to_string());
        }
    }
    let mut dirs: std::collections::HashSet<PathBuf> = Default::default();
    let mut ops = Vec::new();
    for call in calls {
        let Some((name, rest)) = call.split_once('(') else {
            continue;
        };
        let Some((args, result)) = split_result(rest) else {
            continue;
        };
        if result.starts_with('-') || result.starts_with('?') {
            continue; // failed calls, and calls a killed thread never finished, change nothing
        }
        let strings = quoted(args);
        let fds = fd_paths(args);
        // a path argument: absolute as given, or relative to the descriptor before it
        let path_at = |i: usize| -> Option<PathBuf> {
            let s = strings.get(i)?;
            if s.starts_with('/') {
                return Some(PathBuf::from(s));
            }
            let before = args.split(&format!("\"{s}\"")).next().unwrap_or("");
            Some(fd_paths(before).last()?.join(s))
        };
        let op = match name {
            "openat" | "creat" if name == "creat" || args.contains("O_CREAT") => {
                fd_paths(result).pop().map(Op::Create)
            }
            "mkdir" | "mkdirat" => path_at(0)
                .inspect(|p| {
                    dirs.insert(p.clone());
                })
                .map(Op::Create),
            "write" | "pwrite64" | "writev" | "pwritev" | "pwritev2" | "ftruncate" | "fallocate" => {
                fds.first().cloned().map(Op::Write)
            }
            "fsync" | "fdatasync" => fds.first().map(|p| {
                if dirs.contains(p) || p.is_dir() {
                    Op::SyncDir(p.clone())
                } else {
                    Op::Sync(p.clone())
                }
            }),
            "rename" | "renameat" | "renameat2" => match (path_at(0), path_at(1)) {
                (Some(from), Some(to)) if args.contains("RENAME_EXCHANGE") => Some(Op::Exchange(from, to)),
                (Some(from), Some(to)) => {
                    if dirs.contains(&from) {
                        dirs.insert(to.clone());
                    }
                    Some(Op::Rename(from, to))
                }
                _ => None,
            },
            "rmdir" => path_at(0).map(Op::Remove),
            "unlinkat" if args.contains("AT_REMOVEDIR") => path_at(0).map(Op::Remove),
            _ => None,
        };
        ops.extend(op);
    }
    ops
}

/// Checks that the recorded operations publish only durable state: every file of a
/// staging directory synced after its last write and before the rename, the manifest
/// written after every slice is durable, the staging directory synced before its rename,
/// the checkpoints directory synced after it and before `latest` moves, `latest`'s new
/// content synced before its rename and the directory after it, pruning only after.
/// Returns how many checkpoints were published, or the first rule broken.
fn check_durable(ops: &[Op], root: &Path) -> Result<usize, String> {
    let find = |from: usize, to: usize, want: &dyn Fn(&Op) -> bool| (from..to).find(|&i| want(&ops[i]));
    let last = |to: usize, want: &dyn Fn(&Op) -> bool| (0..to).rev().find(|&i| want(&ops[i]));
    let ensure = |ok: bool, what: String| if ok { Ok(()) } else { Err(what) };
    let latest = root.join("latest");
    let latest_tmp = root.join(".latest.tmp");
    let mut published = 0;
    for (r, op) in ops.iter().enumerate() {
        let (Op::Rename(staging, target) | Op::Exchange(staging, target)) = op else {
            continue;
        };
        if save::parse_step(&target.file_name().unwrap().to_string_lossy()).is_none() {
            continue;
        }
        published += 1;
        let start = last(r, &|o| *o == Op::Create(staging.clone())).ok_or("staging never created")?;
        let in_staging = |o: &Op| o.path().parent() == Some(staging.as_path());
        let files: std::collections::BTreeSet<PathBuf> = ops[start..r]
            .iter()
            .filter(|o| matches!(o, Op::Create(_) | Op::Write(_)) && in_staging(o))
            .map(|o| o.path().to_path_buf())
            .collect();
        ensure(files.len() > 1, format!("{}: no files", staging.display()))?;
        for file in &files {
            let written = last(r, &|o| *o == Op::Write(file.clone())).unwrap_or(start);
            ensure(
                find(written, r, &|o| *o == Op::Sync(file.clone())).is_some(),
                format!(
                    "{} not synced between its last write and the rename",
                    file.display()
                ),
            )?;
        }
        let manifest = staging.join("manifest.json");
        let manifest_at = find(start, r, &|o| *o == Op::Create(manifest.clone())).ok_or("no manifest")?;
        ensure(
            find(
                manifest_at,
                r,
                &|o| matches!(o, Op::Sync(p) | Op::Write(p) if *p != manifest),
            )
            .is_none(),
            "a slice written or synced after the manifest".into(),
        )?;
        let created = last(r, &|o| matches!(o, Op::Create(_)) && in_staging(o)).unwrap_or(start);
        ensure(
            find(created, r, &|o| *o == Op::SyncDir(staging.clone())).is_some(),
            format!("{} not synced before its rename", staging.display()),
        )?;
        // this save's operations end where the next save stages
        let save_end = find(
            r,
            ops.len(),
            &|o| matches!(o, Op::Create(p) if p.parent() == Some(root) && p != staging && *p != latest_tmp),
        )
        .unwrap_or(ops.len());
        let moved = find(r, save_end, &|o| {
            *o == Op::Rename(latest_tmp.clone(), latest.clone())
        })
        .ok_or("latest not replaced after the rename")?;
        ensure(
            find(start, r, &|o| {
                *o == Op::Rename(latest_tmp.clone(), latest.clone())
            })
            .is_none(),
            "latest replaced before the checkpoint was published".into(),
        )?;
        if let Some(removed) = find(r, moved, &|o| matches!(o, Op::Remove(_))) {
            ensure(
                find(r, removed, &|o| *o == Op::SyncDir(root.to_path_buf())).is_some(),
                "the replaced copy removed before the exchange was durable".into(),
            )?;
        }
        ensure(
            find(r, moved, &|o| *o == Op::SyncDir(root.to_path_buf())).is_some(),
            "checkpoints directory not synced between the rename and latest's".into(),
        )?;
        let content = last(moved, &|o| *o == Op::Write(latest_tmp.clone())).ok_or("latest never written")?;
        ensure(
            find(content, moved, &|o| *o == Op::Sync(latest_tmp.clone())).is_some(),
            "latest's new content not synced before its rename".into(),
        )?;
        let end = find(
            moved,
            ops.len(),
            &|o| matches!(o, Op::Create(p) if p.parent() == Some(root)),
        )
        .unwrap_or(ops.len());
        let synced = find(moved, end, &|o| *o == Op::SyncDir(root.to_path_buf()))
            .ok_or("checkpoints directory not synced after latest's rename")?;
        let pruned = find(
            moved + 1,
            end,
            &|o| matches!(o, Op::Rename(from, _) if from.parent() == Some(root)),
        );
        ensure(
            pruned.is_none_or(|p| p > synced),
            "pruned before the new latest was durable".into(),
        )?;
    }
    Ok(published)
}

#[test]
fn every_save_makes_its_writes_durable_before_publishing_them() {
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("config.json");
    let config_json = json!({
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": { "type": "AdamW", "params": { "lr": 1e-3 } },
        "zero_optimization": { "stage": 3, "sub_group_size": 1000, "stage3_param_persistence_threshold": 0 },
        "model": { "preset": "llama-tiny", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96 },
        "data": { "synthetic": "markov", "seq_len": 16 },
        "train": { "steps": 3, "devices": 2, "save_interval": 1, "keep_last": 2, "output_dir": tmp.path().join("out") }
    });
    std::fs::write(&config, config_json.to_string()).unwrap();
    let root = save::root(&tmp.path().join("out"));
    // three new steps (the third prunes the first), then step 3 saved again
    let mut lines = traced_train(&config, &[], &tmp.path().join("first.strace"));
    let step_2 = root.join("step-2").display().to_string();
    lines.extend(traced_train(
        &config,
        &["--resume", &step_2],
        &tmp.path().join("again.strace"),
    ));
    let ops: Vec<Op> = parse_trace(&lines)
        .into_iter()
        .filter(|op| op.path().starts_with(&root))
        .collect();
    assert_eq!(check_durable(&ops, &root), Ok(4));
    assert_eq!(ops.iter().filter(|o| matches!(o, Op::Exchange(..))).count(), 1);
    assert!(ops
        .iter()
        .any(|o| matches!(o, Op::Rename(_, to) if to.ends_with(".old-step-1"))));
    // the checker sees every missing fsync: each directory sync dropped in turn, and
    // every sync of one file (each rank syncs every file; one suffices) in turn
    for (i, op) in ops.iter().enumerate() {
        let without: Vec<Op> = match op {
            Op::SyncDir(_) => [&ops[..i], &ops[i + 1..]].concat(),
            Op::Sync(path) => ops
                .iter()
                .filter(|o| **o != Op::Sync(path.clone()))
                .cloned()
                .collect(),
            _ => continue,
        };
        assert!(
            check_durable(&without, &root).is_err(),
            "dropping {op:?} went unnoticed"
        );
    }
    // and a reordering: each save's `latest` replaced just before its checkpoint is
    // published
    let latest_rename = Op::Rename(root.join(".latest.tmp"), root.join("latest"));
    for (i, op) in ops.iter().enumerate() {
        let (Op::Rename(_, to) | Op::Exchange(_, to)) = op else {
            continue;
        };
        if save::parse_step(&to.file_name().unwrap().to_string_lossy()).is_none() {
            continue;
        }
        let moved = (i..ops.len()).find(|&j| ops[j] == latest_rename).unwrap();
        let mut reordered = ops.clone();
        let rename = reordered.remove(moved);
        reordered.insert(i, rename);
        assert!(
            check_durable(&reordered, &root).is_err(),
            "latest moved before {op:?} went unnoticed"
        );
    }
}

/// A misspelt crash point is refused at start-up, naming the variable and the points,
/// instead of a save that silently never stops.
#[test]
fn a_misspelt_crash_point_is_refused_at_start_up() {
    let out = tierzero()
        .args(["plan", "-c", "configs/default.json"])
        .env(crash::VAR, "renmae@2")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("TIERZERO_CRASH_AT=\"renmae@2\": unknown point \"renmae\"")
            && text.contains("latest-rename"),
        "{text}"
    );
}
