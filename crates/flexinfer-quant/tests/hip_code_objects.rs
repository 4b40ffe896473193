//! The HIP code objects of `kernels/gptq.cu` that `scripts/hip/build-code-objects.sh` builds with Debian
//! trixie's hipcc (docs/dev/gptq-device.md, "HIP code objects"). The directory comes from
//! `FLEXINFER_HIP_CODE_OBJECTS`; when it is unset the test prints `SKIPPED` and passes, unless
//! `FLEXINFER_REQUIRE_HIP=1` (CI sets both), which makes a missing build a failure.
//!
//! Per target (gfx1100, gfx906), from `gptq-<target>.hsaco` read with the small ELF reader below: ELF64
//! little-endian, `e_machine` = EM_AMDGPU, the `e_flags` machine field is the target's
//! `EF_AMDGPU_MACH_AMDGCN_*` value, and every kernel has its `.kd` descriptor and its code symbol. From
//! `gptq-<target>.s` (llvm-objdump -d of that file): the sweep kernel forms no fused multiply-add of its own
//! arithmetic; the only FMAs allowed are the ones inside the IEEE division sequence (v_div_scale .. v_rcp ..
//! v_div_fixup), which produces the correctly rounded quotient.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: a panic is the failure report

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Every kernel the GPU session launches (`device::kernel::Kernel::ALL`).
fn kernels() -> Vec<&'static str> {
    flexinfer_quant::device::kernel::Kernel::ALL
        .iter()
        .map(|k| k.entry())
        .collect()
}
/// Target and its EF_AMDGPU_MACH value (LLVM AMDGPUUsage, "AMDGPU ELF Header"; also
/// /usr/include/hsa/amd_hsa_elf.h of the trixie root).
const TARGETS: [(&str, u32); 2] = [("gfx1100", 0x041), ("gfx906", 0x02f)];
const EM_AMDGPU: u16 = 224;
const EF_AMDGPU_MACH: u32 = 0x0ff;

fn code_object_dir() -> Option<PathBuf> {
    match std::env::var_os("FLEXINFER_HIP_CODE_OBJECTS") {
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => {
            let required = std::env::var("FLEXINFER_REQUIRE_HIP").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "FLEXINFER_REQUIRE_HIP=1 but FLEXINFER_HIP_CODE_OBJECTS is not set \
                 (export FLEXINFER_HIP_CODE_OBJECTS=$(bash scripts/hip/build-code-objects.sh))"
            );
            println!(
                "SKIPPED: FLEXINFER_HIP_CODE_OBJECTS is not set (bash scripts/hip/build-code-objects.sh builds them)"
            );
            None
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Symbol {
    name: String,
    kind: u8, // STT_*: 1 object, 2 func
    value: u64,
    size: u64,
    /// Where the symbol's bytes start in the file (its section's sh_offset + value − sh_addr), when its
    /// section has file contents.
    file_off: Option<usize>,
}

struct Elf {
    machine: u16,
    flags: u32,
    symbols: Vec<Symbol>,
}

/// One line of `llvm-objdump -d`: address, mnemonic, encoding (the 32-bit words it prints).
#[derive(Debug, Clone, PartialEq)]
struct Inst {
    addr: u64,
    mnemonic: String,
    words: Vec<u32>,
}

fn rd<const N: usize>(b: &[u8], off: usize) -> Result<[u8; N], String> {
    b.get(off..off + N)
        .map(|s| s.try_into().unwrap())
        .ok_or_else(|| {
            format!(
                "truncated ELF: {N} bytes at {off} past the end ({})",
                b.len()
            )
        })
}
fn u16_at(b: &[u8], off: usize) -> Result<u16, String> {
    rd::<2>(b, off).map(u16::from_le_bytes)
}
fn u32_at(b: &[u8], off: usize) -> Result<u32, String> {
    rd::<4>(b, off).map(u32::from_le_bytes)
}
fn u64_at(b: &[u8], off: usize) -> Result<u64, String> {
    rd::<8>(b, off).map(u64::from_le_bytes)
}
fn cstr(b: &[u8], off: usize) -> Result<String, String> {
    let s = b.get(off..).ok_or("string offset past the end")?;
    let end = s
        .iter()
        .position(|&c| c == 0)
        .ok_or("unterminated string")?;
    Ok(String::from_utf8_lossy(&s[..end]).into_owned())
}

/// ELF64 little-endian header, section headers and the symbols of SHT_SYMTAB / SHT_DYNSYM.
fn parse_elf(b: &[u8]) -> Result<Elf, String> {
    if b.len() < 64 || &b[..4] != b"\x7fELF" {
        return Err(
            "not an ELF file (bad magic; an offload bundle instead of a raw code object?)".into(),
        );
    }
    if b[4] != 2 {
        return Err(format!("EI_CLASS {} is not ELFCLASS64", b[4]));
    }
    if b[5] != 1 {
        return Err(format!("EI_DATA {} is not little-endian", b[5]));
    }
    let machine = u16_at(b, 18)?;
    let flags = u32_at(b, 48)?;
    let shoff = u64_at(b, 40)? as usize;
    let shentsize = u16_at(b, 58)? as usize;
    let shnum = u16_at(b, 60)? as usize;
    if shentsize != 64 {
        return Err(format!("e_shentsize {shentsize} is not 64"));
    }
    let section = |i: usize| -> Result<(u32, usize, usize, u32, usize), String> {
        let h = shoff + i * shentsize;
        Ok((
            u32_at(b, h + 4)?,           // sh_type
            u64_at(b, h + 24)? as usize, // sh_offset
            u64_at(b, h + 32)? as usize, // sh_size
            u32_at(b, h + 40)?,          // sh_link
            u64_at(b, h + 56)? as usize, // sh_entsize
        ))
    };
    let file_off = |shndx: usize, value: u64| -> Result<Option<usize>, String> {
        if shndx == 0 || shndx >= shnum {
            return Ok(None);
        }
        let h = shoff + shndx * shentsize;
        let (ty, off, addr) = (u32_at(b, h + 4)?, u64_at(b, h + 24)?, u64_at(b, h + 16)?);
        Ok((ty != 8 && value >= addr).then(|| (off + value - addr) as usize)) // 8: SHT_NOBITS
    };
    let mut symbols = Vec::new();
    for i in 0..shnum {
        let (ty, off, size, link, entsize) = section(i)?;
        if ty != 2 && ty != 11 {
            continue;
        }
        if entsize != 24 {
            return Err(format!("symbol table entry size {entsize} is not 24"));
        }
        let (_, stroff, _, _, _) = section(link as usize)?;
        for s in (off..off + size).step_by(24).skip(1) {
            symbols.push(Symbol {
                name: cstr(b, stroff + u32_at(b, s)? as usize)?,
                kind: rd::<1>(b, s + 4)?[0] & 0xf,
                value: u64_at(b, s + 8)?,
                size: u64_at(b, s + 16)?,
                file_off: file_off(u16_at(b, s + 6)? as usize, u64_at(b, s + 8)?)?,
            });
        }
    }
    Ok(Elf {
        machine,
        flags,
        symbols,
    })
}

/// `llvm-objdump -d` output: per function label, its address and its instructions (a line is
/// `\tMNEMONIC operands // ADDRESS: WORD WORD…`, words in hex; a branch target may follow).
fn parse_disassembly(text: &str) -> BTreeMap<String, (u64, Vec<Inst>)> {
    let mut out: BTreeMap<String, (u64, Vec<Inst>)> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let t = line.trim_end();
        if let Some(label) = t.strip_suffix(">:") {
            if let Some((addr, name)) = label.split_once(" <") {
                if let Ok(a) = u64::from_str_radix(addr.trim(), 16) {
                    out.insert(name.to_string(), (a, Vec::new()));
                    current = Some(name.to_string());
                    continue;
                }
            }
        }
        if line.starts_with(['\t', ' ']) {
            let (Some(f), Some(m)) = (&current, t.split_whitespace().next()) else {
                continue;
            };
            let Some((_, enc)) = t.rsplit_once("// ") else {
                continue;
            };
            let Some((addr, words)) = enc.split_once(": ") else {
                continue;
            };
            let words: Vec<u32> = words
                .split_whitespace()
                .map_while(|w| {
                    (w.len() == 8)
                        .then(|| u32::from_str_radix(w, 16).ok())
                        .flatten()
                })
                .collect();
            if let (Ok(addr), false) = (
                u64::from_str_radix(addr, 16),
                m.starts_with("//") || words.is_empty(),
            ) {
                out.get_mut(f).unwrap().1.push(Inst {
                    addr,
                    mnemonic: m.to_string(),
                    words,
                });
            }
        } else if t.is_empty() {
            current = None;
        }
    }
    out
}

/// A float multiply-add that rounds once (fused): the VOP families of GCN/RDNA.
fn is_fused(m: &str) -> bool {
    let m = m.split('_').collect::<Vec<_>>();
    let op = m.get(1).copied().unwrap_or("");
    let float = m
        .iter()
        .any(|p| ["f32", "f16", "f64", "bf16", "legacy"].contains(p) || p.starts_with("mix"));
    m.first() == Some(&"v")
        && (matches!(
            op,
            "fma" | "fmac" | "fmamk" | "fmaak" | "dot" | "dot2" | "dot2c"
        ) || op.starts_with("dot")
            || (op == "div" && m.get(2) == Some(&"fmas"))
            || (op == "pk" && m.get(2).is_some_and(|p| p.starts_with("fma")))
            || (matches!(op, "mac" | "mad" | "madmk" | "madak") && float))
}

/// The fused instructions of `insts` outside an IEEE f32 division sequence (v_div_scale_f32 … v_rcp_f32 …
/// v_div_fixup_f32, at most 24 instructions), with their index; and the number of division sequences.
fn fused_outside_division(insts: &[String]) -> (Vec<(usize, String)>, usize) {
    let base = |m: &str| {
        m.trim_end_matches("_e32")
            .trim_end_matches("_e64")
            .trim_end_matches("_dpp")
            .trim_end_matches("_sdwa")
            .to_string()
    };
    let mut inside = vec![false; insts.len()];
    let mut divisions = 0;
    let mut i = 0;
    while i < insts.len() {
        if base(&insts[i]) == "v_div_scale_f32" {
            let end =
                (i + 1..insts.len().min(i + 24)).find(|&j| base(&insts[j]) == "v_div_fixup_f32");
            if let Some(end) = end {
                if insts[i..end].iter().any(|m| base(m) == "v_rcp_f32") {
                    inside[i..=end].iter_mut().for_each(|x| *x = true);
                    divisions += 1;
                    i = end + 1;
                    continue;
                }
            }
        }
        i += 1;
    }
    let outside = insts
        .iter()
        .enumerate()
        .filter(|(k, m)| is_fused(m) && !inside[*k])
        .map(|(k, m)| (k, m.clone()))
        .collect();
    (outside, divisions)
}

/// The mnemonics of function `sym` from its disassembly, after checking that the disassembly is of these
/// bytes: it starts at the symbol, its instructions' encodings are the file's bytes, and they cover the
/// symbol's size exactly (what follows is alignment padding).
fn function_insts(
    elf: &[u8],
    sym: &Symbol,
    dis: Option<&(u64, Vec<Inst>)>,
) -> Result<Vec<String>, String> {
    let (start, insts) = dis.ok_or("not in the disassembly")?;
    if *start != sym.value {
        return Err(format!(
            "disassembled at {start:#x}, the symbol is at {:#x}",
            sym.value
        ));
    }
    let base = sym
        .file_off
        .ok_or("the symbol's section has no file contents")?;
    let end = sym.value + sym.size;
    let mut at = sym.value;
    let mut out = Vec::new();
    for i in insts.iter().take_while(|i| i.addr < end) {
        if i.addr != at {
            return Err(format!("instruction at {:#x}, expected {at:#x}", i.addr));
        }
        for (n, w) in i.words.iter().enumerate() {
            let file = u32_at(elf, base + (i.addr - sym.value) as usize + 4 * n)?;
            if file != *w {
                return Err(format!(
                    "{} at {:#x}: encoding {w:08X}, the file has {file:08X}",
                    i.mnemonic, i.addr
                ));
            }
        }
        at += 4 * i.words.len() as u64;
        out.push(i.mnemonic.clone());
    }
    if at != end {
        return Err(format!(
            "instructions end at {at:#x}, the symbol at {end:#x}"
        ));
    }
    Ok(out)
}

fn check_target(dir: &Path, target: &str, mach: u32) -> Result<(), String> {
    let co = dir.join(format!("gptq-{target}.hsaco"));
    let bytes = std::fs::read(&co).map_err(|e| format!("{}: {e}", co.display()))?;
    let elf = parse_elf(&bytes).map_err(|e| format!("{}: {e}", co.display()))?;
    if elf.machine != EM_AMDGPU {
        return Err(format!(
            "{target}: e_machine {} is not EM_AMDGPU ({EM_AMDGPU})",
            elf.machine
        ));
    }
    if elf.flags & EF_AMDGPU_MACH != mach {
        return Err(format!(
            "{target}: e_flags {:#x} has machine {:#x}, expected {mach:#x}",
            elf.flags,
            elf.flags & EF_AMDGPU_MACH
        ));
    }
    let find = |name: &str, kind: u8| {
        elf.symbols
            .iter()
            .find(|s| s.name == name && s.kind == kind)
    };
    let mut code: BTreeMap<&str, &Symbol> = BTreeMap::new();
    for k in kernels() {
        let kd =
            find(&format!("{k}.kd"), 1).ok_or(format!("{target}: no kernel descriptor {k}.kd"))?;
        if kd.size != 64 {
            return Err(format!(
                "{target}: {k}.kd is {} bytes, a kernel descriptor is 64",
                kd.size
            ));
        }
        let f = find(k, 2).ok_or(format!("{target}: no function symbol {k}"))?;
        if f.size == 0 {
            return Err(format!("{target}: {k} has no code"));
        }
        code.insert(k, f);
    }

    let asm_path = dir.join(format!("gptq-{target}.s"));
    let asm =
        std::fs::read_to_string(&asm_path).map_err(|e| format!("{}: {e}", asm_path.display()))?;
    let funcs = parse_disassembly(&asm);
    let mut code_insts: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (k, sym) in &code {
        let insts = function_insts(&bytes, sym, funcs.get(*k))
            .map_err(|e| format!("{target}: {}: {k}: {e}", asm_path.display()))?;
        code_insts.insert(k, insts);
    }
    let sweep = &code_insts["gptq_sweep_block"];
    let (fused, divisions) = fused_outside_division(sweep);
    if !fused.is_empty() {
        return Err(format!(
            "{target}: gptq_sweep_block forms fused multiply-adds outside a division: {fused:?}"
        ));
    }
    if divisions == 0 {
        return Err(format!(
            "{target}: gptq_sweep_block has no IEEE division sequence (x / s)"
        ));
    }
    for op in ["v_mul_f32", "v_add_f32", "v_sub_f32", "v_rndne_f32"] {
        if !sweep.iter().any(|m| m.starts_with(op)) {
            return Err(format!("{target}: gptq_sweep_block has no {op}"));
        }
    }
    println!(
        "{target}: e_flags {:#x}, 4 kernels, sweep {} instructions, {divisions} division sequence(s), no other FMA",
        elf.flags,
        sweep.len()
    );
    Ok(())
}

#[test]
fn hip_code_objects_are_amdgpu_elfs_with_the_kernels_and_a_sweep_without_fma() {
    let Some(dir) = code_object_dir() else { return };
    let src =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/gptq.cu")).unwrap();
    for k in kernels() {
        assert!(
            src.contains(&format!("GPTQ_KERNEL void {k}(")),
            "gptq.cu declares no {k}"
        );
    }
    let errors: Vec<String> = TARGETS
        .iter()
        .filter_map(|(t, mach)| check_target(&dir, t, *mach).err())
        .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// The checks themselves, on inputs made here: they must reject what they are meant to reject.
/// The binary embeds the code objects it was built with (`build.rs`, from `FLEXINFER_HIP_CODE_OBJECTS` at
/// build time; CI sets it for the build and the run alike): byte for byte the files checked above, one per
/// target, each an AMDGPU ELF of its target.
#[test]
fn the_binary_embeds_the_code_objects_it_was_built_with() {
    use flexinfer_quant::device::driver::code_objects::{
        embedded_targets, EMBEDDED_HIP_CODE_OBJECTS as EMBEDDED,
    };
    let Some(dir) = code_object_dir() else { return };
    let built_with = option_env!("FLEXINFER_HIP_CODE_OBJECTS").unwrap_or("");
    assert_eq!(
        Path::new(built_with).canonicalize().ok(),
        dir.canonicalize().ok(),
        "the test binary was built with FLEXINFER_HIP_CODE_OBJECTS={built_with:?}, run with {}",
        dir.display()
    );
    assert_eq!(
        embedded_targets(),
        {
            let mut t: Vec<_> = TARGETS.iter().map(|(t, _)| *t).collect();
            t.sort();
            t
        },
        "embedded targets"
    );
    for (target, bytes) in EMBEDDED {
        let file = dir.join(format!("gptq-{target}.hsaco"));
        let on_disk = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert!(
            *bytes == on_disk.as_slice(),
            "embedded {target} differs from {}",
            file.display()
        );
        let elf = parse_elf(bytes).unwrap_or_else(|e| panic!("embedded {target}: {e}"));
        let mach = TARGETS.iter().find(|(t, _)| t == target).map(|(_, m)| *m);
        assert_eq!(
            (elf.machine, Some(elf.flags & EF_AMDGPU_MACH)),
            (EM_AMDGPU, mach),
            "embedded {target}"
        );
    }
}

#[test]
fn the_checks_reject_fma_wrong_machine_and_missing_kernels() {
    let insts = |s: &str| s.split_whitespace().map(String::from).collect::<Vec<_>>();
    // The division sequence clang emits for x / s on gfx906 (from the disassembly), FMAs inside it only.
    let div =
        "v_div_scale_f32 v_div_scale_f32 v_rcp_f32_e32 v_fma_f32 v_fmac_f32_e32 v_mul_f32_e32 \
               v_fma_f32 v_fmac_f32_e32 v_fma_f32 v_div_fmas_f32 v_div_fixup_f32";
    assert_eq!(
        fused_outside_division(&insts(&format!("{div} v_rndne_f32_e32 v_add_f32_e32"))),
        (vec![], 1)
    );
    for bad in [
        "v_fmac_f32_e32",
        "v_fma_f32",
        "v_mac_f32_e32",
        "v_mad_f32",
        "v_fma_mix_f32",
        "v_pk_fma_f32",
        "v_fmamk_f32",
        "v_dot2_f32_f16",
        "v_mad_legacy_f32",
        "v_div_fmas_f32",
    ] {
        let (out, n) = fused_outside_division(&insts(&format!("v_mul_f32_e32 {bad} {div}")));
        assert_eq!((out, n), (vec![(1, bad.to_string())], 1), "{bad}");
    }
    // Integer multiply-adds are address arithmetic, not float contraction.
    assert!(!is_fused("v_mad_u64_u32") && !is_fused("v_mad_u32_u24") && !is_fused("v_mad_i64_i32"));
    // A division-like window without the reciprocal does not excuse an FMA.
    let fake = insts("v_div_scale_f32 v_fma_f32 v_div_fixup_f32");
    assert_eq!(fused_outside_division(&fake).0.len(), 1);

    // The disassembly reader.
    let text = "\n/work/x.hsaco:\tfile format elf64-amdgpu\n\nDisassembly of section .text:\n\n\
                0000000000000010 <f>:\n\
                \tv_mul_f32_e32 v9, v13, v9                                  // 000000000010: 0A12130D\n\
                \ts_cbranch_scc1 186                                         // 000000000014: BF8500BA <f+0x2f0>\n\
                \tv_fma_f32 v14, -v8, v10, 1.0                               // 000000000018: D1CB000E 23CA1508\n\
                \ts_code_end                                                 // 000000000020: BF9F0000\n\n";
    let f = parse_disassembly(text);
    let inst = |addr, m: &str, words: &[u32]| Inst {
        addr,
        mnemonic: m.into(),
        words: words.to_vec(),
    };
    let want = vec![
        inst(0x10, "v_mul_f32_e32", &[0x0A12130D]),
        inst(0x14, "s_cbranch_scc1", &[0xBF8500BA]),
        inst(0x18, "v_fma_f32", &[0xD1CB000E, 0x23CA1508]),
        inst(0x20, "s_code_end", &[0xBF9F0000]),
    ];
    assert_eq!(f["f"], (0x10, want));
    // function_insts: the bytes must be the file's and cover the symbol (0x10 bytes; s_code_end is padding).
    let mut file = vec![0u8; 0x44];
    for (k, w) in [
        0x0A12130Du32,
        0xBF8500BA,
        0xD1CB000E,
        0x23CA1508,
        0xBF9F0000,
    ]
    .iter()
    .enumerate()
    {
        file[0x30 + 4 * k..0x34 + 4 * k].copy_from_slice(&w.to_le_bytes());
    }
    let sym = |size| Symbol {
        name: "f".into(),
        kind: 2,
        value: 0x10,
        size,
        file_off: Some(0x30),
    };
    assert_eq!(
        function_insts(&file, &sym(0x10), f.get("f")).unwrap(),
        ["v_mul_f32_e32", "s_cbranch_scc1", "v_fma_f32"]
    );
    let err = function_insts(&file, &sym(0x12), f.get("f")).unwrap_err(); // ends inside an instruction
    assert!(err.contains("end at 0x24"), "{err}");
    assert!(function_insts(&file, &sym(0x0e), f.get("f")).is_err());
    file[0x3c] ^= 1; // the FMA's second word differs: another file's disassembly
    let err = function_insts(&file, &sym(0x10), f.get("f")).unwrap_err();
    assert!(err.contains("v_fma_f32 at 0x18"), "{err}");
    assert!(function_insts(&file, &sym(0x10), None).is_err());

    // The ELF reader on a minimal ELF64 with one symbol table.
    let elf = minimal_elf(0x52f, "gptq_sweep_block.kd");
    let e = parse_elf(&elf).unwrap();
    assert_eq!((e.machine, e.flags & EF_AMDGPU_MACH), (EM_AMDGPU, 0x2f));
    assert_eq!(
        e.symbols,
        vec![Symbol {
            name: "gptq_sweep_block.kd".into(),
            kind: 1,
            value: 0x1180,
            size: 64,
            file_off: None,
        }]
    );
    let mut bundle = elf.clone();
    bundle[..4].copy_from_slice(b"__CL");
    assert!(parse_elf(&bundle).is_err());
    let mut elf32 = elf.clone();
    elf32[4] = 1;
    assert!(parse_elf(&elf32).is_err());

    // check_target on a directory with that ELF: wrong machine, then missing kernels, are reported.
    let dir = std::env::temp_dir().join(format!("hip-co-check-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("gptq-gfx906.hsaco"), &elf).unwrap();
    let err = check_target(&dir, "gfx906", 0x41).unwrap_err();
    assert!(err.contains("expected 0x41"), "{err}");
    let err = check_target(&dir, "gfx906", 0x2f).unwrap_err();
    assert!(
        err.contains("no kernel descriptor gptq_hessian_lower.kd"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// ELF64 LE, EM_AMDGPU, `flags`; sections: null, .strtab, .symtab (one OBJECT symbol `sym`, 64 bytes).
fn minimal_elf(flags: u32, sym: &str) -> Vec<u8> {
    let mut strtab = vec![0u8];
    strtab.extend_from_slice(sym.as_bytes());
    strtab.push(0);
    let mut symtab = vec![0u8; 24];
    let mut s = Vec::new();
    s.extend_from_slice(&1u32.to_le_bytes()); // st_name
    s.push(0x11); // GLOBAL OBJECT
    s.push(3); // st_other
    s.extend_from_slice(&6u16.to_le_bytes());
    s.extend_from_slice(&0x1180u64.to_le_bytes());
    s.extend_from_slice(&64u64.to_le_bytes());
    symtab.extend_from_slice(&s);
    let str_off = 64usize;
    let sym_off = str_off + strtab.len();
    let sh_off = sym_off + symtab.len();
    let mut b = vec![0u8; 64];
    b[..4].copy_from_slice(b"\x7fELF");
    b[4] = 2;
    b[5] = 1;
    b[6] = 1;
    b[18..20].copy_from_slice(&EM_AMDGPU.to_le_bytes());
    b[40..48].copy_from_slice(&(sh_off as u64).to_le_bytes());
    b[48..52].copy_from_slice(&flags.to_le_bytes());
    b[58..60].copy_from_slice(&64u16.to_le_bytes());
    b[60..62].copy_from_slice(&3u16.to_le_bytes());
    b.extend_from_slice(&strtab);
    b.extend_from_slice(&symtab);
    let sh = |ty: u32, off: usize, size: usize, link: u32, entsize: u64| {
        let mut h = vec![0u8; 64];
        h[4..8].copy_from_slice(&ty.to_le_bytes());
        h[24..32].copy_from_slice(&(off as u64).to_le_bytes());
        h[32..40].copy_from_slice(&(size as u64).to_le_bytes());
        h[40..44].copy_from_slice(&link.to_le_bytes());
        h[56..64].copy_from_slice(&entsize.to_le_bytes());
        h
    };
    b.extend_from_slice(&[0u8; 64]);
    b.extend_from_slice(&sh(3, str_off, strtab.len(), 0, 0));
    b.extend_from_slice(&sh(2, sym_off, symtab.len(), 1, 24));
    b
}
