//! The image builder against real inputs: reproducibility, layout (unpacked with the
//! real `cpio`), modules (plain and compressed, built-in ones dropped), refusals.

use super::*;
use serde_json::json;

fn busybox() -> Option<PathBuf> {
    let p = PathBuf::from("/bin/busybox");
    if p.exists() {
        return Some(p);
    }
    if std::env::var("REQUIRE_ALL").is_ok_and(|v| v == "1") {
        panic!("/bin/busybox (busybox-static) is required for this test and missing");
    }
    eprintln!("SKIPPED: /bin/busybox (busybox-static) is missing");
    None
}

fn fake_kernel(dir: &Path) -> PathBuf {
    let k = dir.join("lib/modules/6.1.0-test");
    std::fs::create_dir_all(k.join("kernel/v")).unwrap();
    std::fs::write(
        k.join("modules.dep"),
        "kernel/v/b.ko: kernel/v/a.ko\nkernel/v/a.ko:\n",
    )
    .unwrap();
    std::fs::write(k.join("modules.builtin"), "kernel/fs/ext4.ko\n").unwrap();
    std::fs::write(k.join("kernel/v/a.ko"), b"\x7fELF module a").unwrap();
    std::fs::write(k.join("kernel/v/b.ko"), b"\x7fELF module b").unwrap();
    k
}

#[test]
fn same_inputs_give_same_bytes_and_modules_are_expanded() {
    let Some(init) = busybox() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let k = fake_kernel(tmp.path());
    let app = tmp.path().join("app");
    std::fs::write(&app, b"app bytes").unwrap();
    let mut spec = InitramfsSpec::new(&init, json!({"modules": ["b", "ext4"], "z": 1, "a": 2}));
    spec.kernel_modules = Some(k.clone());
    spec.files.push(ExtraFile {
        guest_path: "/app/bin/app".into(),
        source: Source::Host(app.clone()),
        mode: 0o755,
    });
    let one = build(&spec).unwrap();
    // Touch the inputs' metadata: times must not leak into the image.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    std::fs::write(&app, b"app bytes").unwrap();
    let two = build(&spec).unwrap();
    assert_eq!(one.bytes, two.bytes);
    assert_eq!(one.config["modules"], json!(["a", "b"]));
    // No power-button modules in this kernel: none are added.
    assert_eq!(one.modules.len(), 2);
    assert_eq!(one.builtin, ["ext4"]);

    // Unpack with the real cpio tool and check the layout.
    let out = tmp.path().join("x");
    std::fs::create_dir(&out).unwrap();
    let raw = {
        let mut d = flate2::read::GzDecoder::new(&one.bytes[..]);
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut d, &mut v).unwrap();
        v
    };
    assert_eq!(raw.len() as u64, one.uncompressed_size);
    let mut child = std::process::Command::new("cpio")
        .args(["-i", "-d", "--quiet"])
        .current_dir(&out)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&raw).unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(
        std::fs::read(out.join("lib/modules/a.ko")).unwrap(),
        b"\x7fELF module a"
    );
    assert_eq!(
        std::fs::read(out.join("lib/modules/b.ko")).unwrap(),
        b"\x7fELF module b"
    );
    assert_eq!(
        std::fs::read(out.join("app/bin/app")).unwrap(),
        b"app bytes"
    );
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(out.join("etc/guest-init.json")).unwrap()).unwrap();
    assert_eq!(cfg["modules"], json!(["a", "b"]));
    assert_eq!(
        std::fs::read(out.join("init")).unwrap(),
        std::fs::read(&init).unwrap()
    );
}

/// Compresses `data` with a real tool the way kernel builds do (`xz --check=crc32
/// --lzma2=dict=1MiB`, `zstd`), or `None` (skip, or fail under REQUIRE_ALL) without it.
fn compress_with(tool: &str, args: &[&str], data: &[u8]) -> Option<Vec<u8>> {
    let spawned = std::process::Command::new(tool)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn();
    let Ok(mut child) = spawned else {
        if std::env::var("REQUIRE_ALL").is_ok_and(|v| v == "1") {
            panic!("`{tool}` is required for this test and missing (scripts/setup.sh)");
        }
        eprintln!("SKIPPED: `{tool}` is missing (scripts/setup.sh installs it)");
        return None;
    };
    let mut stdin = child.stdin.take().unwrap();
    let input = data.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(out.status.success(), "{tool} failed");
    Some(out.stdout)
}

/// A fake module: an ELF magic, then bytes that compress but not to nothing.
fn fake_module(tag: &str, len: usize) -> Vec<u8> {
    let mut v = b"\x7fELF\x02\x01\x01".to_vec();
    let mut x: u32 = 0x2545_f491;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.extend_from_slice(tag.as_bytes());
        v.push((x % 16) as u8);
    }
    v
}

#[test]
fn compressed_modules_are_stored_decompressed_and_builtins_dropped() {
    let Some(init) = busybox() else { return };
    let (a, b, c) = (
        fake_module("xz-mod ", 200_000),
        fake_module("zstd-mod ", 150_000),
        fake_module("plain ", 1_000),
    );
    let Some(a_xz) = compress_with("xz", &["--check=crc32", "--lzma2=dict=1MiB", "-c"], &a) else {
        return;
    };
    let Some(b_zst) = compress_with("zstd", &["-q", "-19", "-c"], &b) else {
        return;
    };
    assert!(a_xz.len() < a.len() / 2 && b_zst.len() < b.len() / 2);
    let tmp = tempfile::tempdir().unwrap();
    let k = tmp.path().join("lib/modules/6.12.0-test");
    std::fs::create_dir_all(k.join("kernel/v")).unwrap();
    // As 6.12 has it: virtio_pci built in, the rest compressed.
    std::fs::write(
        k.join("modules.dep"),
        "kernel/v/b.ko.zst: kernel/v/a.ko.xz\nkernel/v/a.ko.xz:\nkernel/v/c.ko:\n",
    )
    .unwrap();
    std::fs::write(
        k.join("modules.builtin"),
        "kernel/drivers/virtio/virtio_pci.ko\n",
    )
    .unwrap();
    std::fs::write(k.join("kernel/v/a.ko.xz"), &a_xz).unwrap();
    std::fs::write(k.join("kernel/v/b.ko.zst"), &b_zst).unwrap();
    std::fs::write(k.join("kernel/v/c.ko"), &c).unwrap();
    let mut spec = InitramfsSpec::new(&init, json!({"modules": ["virtio_pci", "b", "c"]}));
    spec.kernel_modules = Some(k);
    let t = std::time::Instant::now();
    let one = build(&spec).unwrap();
    eprintln!(
        "built with 350 kB of compressed modules in {:?}",
        t.elapsed()
    );
    assert_eq!(one.config["modules"], json!(["a", "b", "c"]));
    assert_eq!(one.builtin, ["virtio_pci"]);
    assert_eq!(build(&spec).unwrap().bytes, one.bytes, "not reproducible");

    let out = tmp.path().join("x");
    unpack(&one.bytes, &out);
    assert!(std::fs::read(out.join("lib/modules/a.ko")).unwrap() == a);
    assert!(std::fs::read(out.join("lib/modules/b.ko")).unwrap() == b);
    assert!(std::fs::read(out.join("lib/modules/c.ko")).unwrap() == c);
    assert!(!out.join("lib/modules/virtio_pci.ko").exists());
    let names: Vec<_> = std::fs::read_dir(out.join("lib/modules"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");

    // A damaged file is named, not loaded.
    let bad = spec
        .kernel_modules
        .as_ref()
        .unwrap()
        .join("kernel/v/a.ko.xz");
    std::fs::write(&bad, &a_xz[..a_xz.len() / 2]).unwrap();
    let msg = build(&spec).unwrap_err().to_string();
    assert!(msg.contains("a.ko.xz") && msg.contains("corrupt"), "{msg}");
}

/// Gunzips `bytes` and unpacks the cpio archive into `out` with GNU cpio.
fn unpack(bytes: &[u8], out: &Path) {
    std::fs::create_dir(out).unwrap();
    let mut raw = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(bytes), &mut raw).unwrap();
    let mut child = std::process::Command::new("cpio")
        .args(["-i", "-d", "--quiet"])
        .current_dir(out)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&raw).unwrap();
    assert!(child.wait().unwrap().success());
}

#[test]
fn power_button_modules_are_added_when_the_kernel_has_them() {
    let Some(init) = busybox() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let k = fake_kernel(tmp.path());
    std::fs::create_dir_all(k.join("kernel/acpi")).unwrap();
    let mut dep = std::fs::read_to_string(k.join("modules.dep")).unwrap();
    dep.push_str("kernel/acpi/button.ko:\nkernel/v/evdev.ko:\n");
    std::fs::write(k.join("modules.dep"), dep).unwrap();
    std::fs::write(k.join("kernel/acpi/button.ko"), b"\x7fELF button").unwrap();
    std::fs::write(k.join("kernel/v/evdev.ko"), b"\x7fELF evdev").unwrap();
    let mut spec = InitramfsSpec::new(&init, json!({"modules": ["b"]}));
    spec.kernel_modules = Some(k.clone());
    let img = build(&spec).unwrap();
    assert_eq!(img.config["modules"], json!(["a", "b", "button", "evdev"]));
    // Listed already: not twice.
    spec.config = json!({"modules": ["evdev", "b"]});
    let img = build(&spec).unwrap();
    assert_eq!(img.config["modules"], json!(["evdev", "a", "b", "button"]));
    // No modules at all: the configuration stays as it is.
    spec.config = json!({});
    assert_eq!(build(&spec).unwrap().config.get("modules"), None);
}

#[test]
fn different_content_gives_different_bytes() {
    let Some(init) = busybox() else { return };
    let a = build(&InitramfsSpec::new(&init, json!({"x": 1}))).unwrap();
    let b = build(&InitramfsSpec::new(&init, json!({"x": 2}))).unwrap();
    assert_ne!(a.bytes, b.bytes);
}

#[test]
fn dynamic_init_is_refused() {
    let err = build(&InitramfsSpec::new("/bin/sh", json!({}))).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("/bin/sh") && msg.contains("dynamically linked"),
        "{msg}"
    );
}

#[test]
fn missing_module_is_named() {
    let Some(init) = busybox() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let k = fake_kernel(tmp.path());
    let mut spec = InitramfsSpec::new(&init, json!({"modules": ["a", "vsock_nope"]}));
    spec.kernel_modules = Some(k);
    let msg = build(&spec).unwrap_err().to_string();
    assert!(msg.contains("\"vsock_nope\""), "{msg}");
    let msg = build(&InitramfsSpec::new(&init, json!({"modules": ["a"]})))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("no kernel module directory"), "{msg}");
    let msg = build(&InitramfsSpec::new(&init, json!({"modules": "a"})))
        .unwrap_err()
        .to_string();
    assert!(msg.starts_with("config.modules:"), "{msg}");
}

#[test]
fn oversized_image_is_refused_with_sizes() {
    let Some(init) = busybox() else { return };
    let mut spec = InitramfsSpec::new(&init, json!({}));
    spec.max_size = 1000;
    let msg = build(&spec).unwrap_err().to_string();
    assert!(msg.contains("over the limit of 1000 bytes"), "{msg}");
    assert!(msg.contains("root disk"), "{msg}");
}
