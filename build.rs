//! Build script: makes the `tierzero` binary start with no environment variables, and
//! compiles the small C++ bridges to libtorch (`src/torch/shim.cpp`, and c10d's store and
//! Gloo in `src/torch/c10d.cpp`, for the torch release the Makefile pins).
//!
//! torch-sys links libtorch but adds no rpath, and the linker's `--as-needed` drops
//! `libtorch_cuda.so` because nothing references it by symbol (then CUDA reports
//! unavailable even on a GPU). cudarc looks NCCL up as `libnccl.so`, a name the pip
//! wheel does not ship (only `libnccl.so.2`): a `nccl/libnccl.so` symlink next to the
//! binary, on its rpath as `$ORIGIN/nccl`, fixes that. See `../shared/TOOLCHAIN.md`.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/torch/shim.cpp");
    println!("cargo:rerun-if-changed=src/torch/c10d.cpp");
    println!("cargo:rerun-if-changed=src/torch/bridge.h");
    println!("cargo:rerun-if-changed=src/torch/gloo_stub");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    // torch-sys is a direct dependency with `links = "tch"`, so cargo hands us its lib dir.
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        println!("cargo:warning=torch-sys did not report its lib dir; set LD_LIBRARY_PATH to torch/lib at run time");
        return;
    };
    let lib_dir = PathBuf::from(lib_dir);
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    if lib_dir.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--push-state,--no-as-needed,-ltorch_cuda,--pop-state");
    }
    check_torch_version(&lib_dir);
    compile_shim(&lib_dir);
    link_nccl(&lib_dir);
    link_tcmalloc();
}

/// The binary's allocator (`src/main.rs`): gperftools' tcmalloc, linked whole into the
/// executable so that its `malloc` serves libtorch too, from Debian's
/// `libgoogle-perftools-dev` (`make setup` installs it).
fn link_tcmalloc() {
    const ARCHIVE: &str = "libtcmalloc_minimal.a";
    let dirs = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ];
    let Some(dir) = dirs.iter().find(|d| Path::new(d).join(ARCHIVE).exists()) else {
        panic!(
            "{ARCHIVE} not found in {dirs:?}: install Debian's libgoogle-perftools-dev (`make setup` does)"
        );
    };
    println!("cargo:rerun-if-changed={dir}/{ARCHIVE}");
    println!("cargo:rustc-link-arg-bins=-Wl,--whole-archive,{dir}/{ARCHIVE},--no-whole-archive");
    println!("cargo:rustc-link-arg-bins=-lstdc++");
}

/// The c10d bridge compiles against this torch's headers and the gloo stand-ins match
/// the layout of `ProcessGroupGloo` in this release only.
const TORCH_RELEASE: &str = "2.11.";

fn check_torch_version(lib_dir: &Path) {
    let file = lib_dir.join("../version.py");
    let text = std::fs::read_to_string(&file).unwrap_or_default();
    let version = text
        .lines()
        .find_map(|l| l.strip_prefix("__version__ = "))
        .map(|v| v.trim_matches(|c| c == '\'' || c == '"').to_string());
    match version {
        Some(v) if v.starts_with(TORCH_RELEASE) => {}
        other => panic!(
            "tierzero's c10d bridge (src/torch/c10d.cpp) is built for torch {TORCH_RELEASE}x, but LIBTORCH points at torch {} ({}); run `make setup` (it installs the pinned torch into .venv) or point LIBTORCH at a torch {TORCH_RELEASE}x",
            other.as_deref().unwrap_or("of unknown version"),
            file.display()
        ),
    }
}

/// Both bridges in one C++17 build against libtorch's headers, with torch's C++ ABI,
/// compiled at once (cc's `parallel`: the build waits for this script).
fn compile_shim(lib_dir: &Path) {
    let include = lib_dir.join("../include");
    cc::Build::new()
        .cpp(true)
        .files(["src/torch/shim.cpp", "src/torch/c10d.cpp"])
        // c10d (TCPStore, ProcessGroupGloo): the wheel ships c10d's headers but not gloo's
        .include("src/torch/gloo_stub")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false)
        .compile("tierzero_bridges");
}

/// `target/<profile>/nccl/libnccl.so` → the wheel's `libnccl.so.2`, and `$ORIGIN/nccl`
/// on the rpath. On another machine, `tierzero` repairs a dangling link at run time.
fn link_nccl(lib_dir: &Path) {
    println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/nccl");
    let Some(profile_dir) = std::env::var_os("OUT_DIR").and_then(|out| {
        // OUT_DIR is target/<profile>/build/<package-hash>/out
        Path::new(&out).ancestors().nth(3).map(Path::to_path_buf)
    }) else {
        return;
    };
    let wheel = lib_dir.join("../../nvidia/nccl/lib/libnccl.so.2");
    // the binary's directory, and deps/ where cargo's test binaries live
    for dir in [profile_dir.join("nccl"), profile_dir.join("deps/nccl")] {
        let _ = std::fs::create_dir_all(&dir);
        let link = dir.join("libnccl.so");
        if wheel.exists() && std::fs::read_link(&link).ok().as_deref() != Some(wheel.as_path()) {
            let _ = std::fs::remove_file(&link);
            if let Err(e) = std::os::unix::fs::symlink(&wheel, &link) {
                println!("cargo:warning=cannot link {}: {e}", link.display());
            }
        }
    }
}
