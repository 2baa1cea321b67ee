//! Tells the tests which SIMD kernels the machine that builds them can run, so a kernel
//! this CPU lacks shows as an ignored test (named, with the reason) rather than a pass.
//! The tests check at run time that the CPU agrees.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(cpu_has_avx512f)");
    println!("cargo::rerun-if-changed=build.rs");
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has = |flag: &str| {
        flags
            .lines()
            .filter(|l| l.starts_with("flags"))
            .any(|l| l.split_whitespace().any(|f| f == flag))
    };
    if has("avx512f") {
        println!("cargo::rustc-cfg=cpu_has_avx512f");
    }
}
