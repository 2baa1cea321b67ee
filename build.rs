//! Build script: makes the `tierzero` binary start with no environment variables.
//!
//! torch-sys links libtorch but adds no rpath, and the linker's `--as-needed` drops
//! `libtorch_cuda.so` because nothing references it by symbol (then CUDA reports
//! unavailable even on a GPU). See `../shared/TOOLCHAIN.md`. Both are fixed here.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    // torch-sys is a direct dependency with `links = "tch"`, so cargo hands us its lib dir.
    let Ok(lib_dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        println!("cargo:warning=torch-sys did not report its lib dir; set LD_LIBRARY_PATH to torch/lib at run time");
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    let cuda_lib = std::path::Path::new(&lib_dir).join("libtorch_cuda.so");
    if cuda_lib.exists() {
        println!("cargo:rustc-link-arg=-Wl,--push-state,--no-as-needed,-ltorch_cuda,--pop-state");
    }
}
