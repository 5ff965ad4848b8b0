"""codegen/sass.py: the control bits decoded from the encodings, the exposed global-load waits and which of them are
serial round trips, loops, nvdisasm's labels; on a compiled kernel (with nvdisasm): the MLA tensor-core combine's
epilogue waits once per gate value unless K3FUSE_MLA_CMMA_PRE preloads them."""
import pytest

from k3fuse.codegen import sass


def hi(wbar=7, rbar=7, wait=0, stall=1):
    return (stall << 41) | (1 << 45) | (wbar << 46) | (rbar << 49) | (wait << 52)


def listing(rows, labels=None, func="kernel_cutlass_demo_kernel_tensorptr0", nvdisasm=False):
    """SASS text as cuobjdump -sass (or nvdisasm -c -hex) prints it: rows of (text, control word)."""
    out = [f"\t\tFunction : {func}" if not nvdisasm else f".text.{func}:"]
    for n, (text, word) in enumerate(rows):
        for name, at in (labels or {}).items():
            if at == n:
                out.append(f"{name}:")
        out.append(f"        /*{16 * n:04x}*/                   {text} ;     /* 0x{0x1234 + n:016x} */")
        out.append(f"                                                 /* 0x{word:016x} */")
    return "\n".join(out) + "\n"


def test_control_bits_decoded():
    # encodings from an sm_90a combine: LDC (wbar 0), an LDG (wbar 5, rbar 1), an instruction waiting on scoreboard 1
    text = "\n".join(["\t\tFunction : kernel_cutlass_x_kernel_a",
                      "        /*0000*/                   LDC R1, c[0x0][0x28] ;  /* 0x00000a00ff017b82 */",
                      "                                                           /* 0x000e300000000800 */",
                      "        /*0170*/                   LDG.E.128 R64, desc[UR6][R74.64] ;  /* 0x000000064a407981 */",
                      "                                                           /* 0x000368000c1e1d00 */",
                      "        /*0180*/               @!P0 ULEA UR4, UR4, UR5, 0x18 ;  /* 0x0000000504047291 */",
                      "                                                           /* 0x002fe2000f8ec03f */"])
    (name, ins), = sass.parse(text).items()
    assert name == "kernel_cutlass_x_kernel_a" and [i.addr for i in ins] == [0, 0x170, 0x180]
    assert (ins[0].stall, ins[0].wbar, ins[0].rbar, ins[0].wait) == (8, 0, 7, 0)
    assert (ins[1].stall, ins[1].wbar, ins[1].rbar, ins[1].wait) == (4, 5, 1, 0)
    assert ins[1].global_read and not ins[0].global_read
    assert ins[2].wait == 0b10 and ins[2].text.startswith("ULEA")      # the predicate is not part of the text


def test_serial_and_overlapped_waits():
    rows = [("LDG.E R2, desc[UR4][R4.64]", hi(wbar=2)),            # 0: load A
            ("LDG.E R3, desc[UR4][R6.64]", hi(wbar=3)),            # 1: load B, in flight with A
            ("FADD R8, R2, 1", hi(wait=0b100)),                    # 2: waits for A: a round trip
            ("FADD R9, R3, 1", hi(wait=0b1000)),                   # 3: waits for B: already in flight, overlapped
            ("LDS R10, [R11]", hi(wbar=4)),                        # 4: shared: not a global wait
            ("FADD R12, R10, 1", hi(wait=0b10000)),
            ("LDG.E.U16 R13, desc[UR4][R14.64]", hi(wbar=2)),      # 6: issued after the last wait
            ("SHF.L.U32 R13, R13, 0x10, RZ", hi(wait=0b100)),      # 7: a second round trip
            ("STG.E.U16 desc[UR4][R16.64], R13", hi(rbar=1)),
            ("EXIT", hi())]
    (rep,) = [sass.global_waits(n, i) for n, i in sass.parse(listing(rows)).items()]
    assert rep.global_reads == 3
    assert [(w.at.addr // 16, [l.addr // 16 for l in w.loads], w.serial) for w in rep.waits] == \
        [(2, [0], True), (3, [1], False), (7, [6], True)]
    assert rep.serial == rep.path == 2


def test_a_wait_releases_every_load_on_its_scoreboard():
    rows = [("LDG.E R2, desc[UR4][R4.64]", hi(wbar=5)),
            ("LDG.E R3, desc[UR4][R4.64+0x4]", hi(wbar=5)),
            ("FADD R8, R2, R3", hi(wait=0b100000)),
            ("FADD R9, R3, 1", hi(wait=0b100000)),      # nothing left pending on 5: no second wait
            ("EXIT", hi())]
    rep = sass.global_waits("f", sass.parse(listing(rows))["kernel_cutlass_demo_kernel_tensorptr0"])
    assert len(rep.waits) == 1 and len(rep.waits[0].loads) == 2 and rep.serial == 1


def test_loops_and_nvdisasm_labels():
    rows = [("MOV R1, RZ", hi()),
            ("LDG.E R2, desc[UR4][R4.64]", hi(wbar=0)),       # 1: loop head (label .L_x_1)
            ("FADD R1, R1, R2", hi(wait=0b1)),
            ("@P0 BRA `(.L_x_1)", hi()),                       # back to 1: a loop
            ("LDG.E R5, desc[UR4][R6.64]", hi(wbar=0)),
            ("FADD R1, R1, R5", hi(wait=0b1)),
            ("BRA `(.L_x_2)", hi()),                           # forward: not a loop
            ("EXIT", hi())]
    funcs = sass.parse(listing(rows, labels={".L_x_1": 1, ".L_x_2": 7}, nvdisasm=True))
    ins = funcs["kernel_cutlass_demo_kernel_tensorptr0"]
    assert ins[3].text == "BRA 0x10" and ins[6].text == "BRA 0x70"
    assert sass.loops(ins) == [(0x10, 0x30)]
    rep = sass.global_waits("f", ins)
    assert [(w.serial, w.loop) for w in rep.waits] == [(True, True), (True, False)]
    assert rep.serial == rep.path == 2         # the loop body once, then the load after it
    assert sass.short("kernel_cutlass_combine_mma_kernel_tensorptrf32gmem") == "combine_mma_kernel"


def test_branch_arms_are_alternatives():
    # if (p) { load a; use a } else { load b; use b }; load c; use c: two serial waits in code order on each path
    # (a or b, then c), three in the listing
    rows = [("ISETP.NE.AND P0, PT, R0, RZ, PT", hi()),
            ("@P0 BRA `(.L_x_0)", hi()),
            ("LDG.E R2, desc[UR4][R4.64]", hi(wbar=1)),
            ("FADD R3, R2, 1", hi(wait=0b10)),
            ("BRA `(.L_x_1)", hi()),
            ("LDG.E R2, desc[UR4][R6.64]", hi(wbar=1)),      # .L_x_0
            ("FADD R3, R2, 2", hi(wait=0b10)),
            ("LDG.E R5, desc[UR4][R8.64]", hi(wbar=2)),      # .L_x_1
            ("FADD R6, R5, R3", hi(wait=0b100)),
            ("EXIT", hi())]
    ins = sass.parse(listing(rows, labels={".L_x_0": 5, ".L_x_1": 7}, nvdisasm=True))[
        "kernel_cutlass_demo_kernel_tensorptr0"]
    assert ins[1].guarded and not ins[4].guarded
    rep = sass.global_waits("f", ins)
    assert rep.serial == 3 and rep.path == 2
    # a wait that releases a load issued before the previous wait on the path is not serial: B issued with A
    rows = [("LDG.E R2, desc[UR4][R4.64]", hi(wbar=1)), ("LDG.E R3, desc[UR4][R6.64]", hi(wbar=2)),
            ("@P0 BRA `(.L_x_0)", hi()), ("FADD R7, R2, 1", hi(wait=0b10)),
            ("FADD R8, R3, 1", hi(wait=0b100)), ("EXIT", hi())]          # .L_x_0 at the second FADD
    rep = sass.global_waits("f", sass.parse(listing(rows, labels={".L_x_0": 4}, nvdisasm=True))[
        "kernel_cutlass_demo_kernel_tensorptr0"])
    assert rep.path == 1 and [w.serial for w in rep.waits] == [True, False]


def test_jump_table_targets_are_reachable():
    # switch (r) { case 0: load a; use; case 1: load b; use } via BRX: both cases are on some path
    rows = [("BRX R4 -0x20", hi()),
            ("LDG.E R2, desc[UR4][R4.64]", hi(wbar=1)),       # case 0
            ("FADD R3, R2, 1", hi(wait=0b10)),
            ("BRA `(.L_x_1)", hi()),
            ("LDG.E R2, desc[UR4][R6.64]", hi(wbar=1)),       # case 1
            ("LDG.E R5, desc[UR4][R6.64+0x4]", hi(wbar=2)),
            ("FADD R3, R2, 2", hi(wait=0b10)),
            ("FADD R3, R5, R3", hi(wait=0b100)),
            ("EXIT", hi())]                                    # .L_x_1
    ins = sass.parse(listing(rows, labels={".L_x_1": 8}, nvdisasm=True))["kernel_cutlass_demo_kernel_tensorptr0"]
    blocks, succ = sass._blocks(ins)
    assert succ[0] == [1, 2]
    assert sass.global_waits("f", ins).path == 1


@pytest.mark.parametrize("pre", ["0", "5"])
def test_mla_combine_gate_waits_in_the_sass(pre, monkeypatch, capsys):
    """The compiled TP16 bucket-64 combine (sm_90a, 4 tokens per CTA, gated): with K3FUSE_MLA_CMMA_PRE=0 each of the
    thread's 4 gate values is loaded after the MMAs and waited for on its own (4 serial LDG.U16 round trips in the
    epilogue); with 5 (the default) they load at the start and no global load is waited for after the last MMA; the
    most serial round trips on a path drop (15 -> 6 when written; a lane at NS = 9 waits 10 -> 3 times by hand)."""
    pytest.importorskip("cutlass")
    if sass.find_disassembler() is None:
        pytest.skip("no nvdisasm / cuobjdump (pip install nvidia-cuda-nvdisasm)")
    from k3fuse.codegen import mla_attention as ma
    monkeypatch.setenv("K3FUSE_MLA_CMMA_PRE", pre)
    k = ma.build(6, 128, 128, 64, 512, 192 ** -0.5, splits=(4, 1), append_eps=1e-6, gate=True, out_dtype="bfloat16",
                 cmma=True, ctok=4, asy=1, arch="sm_90a", load=False)
    (rep,) = sass.read(k.files["kernel.cubin"], "combine_mma")
    last_mma = max(i.addr for i in rep.instrs if i.opcode.startswith("HMMA"))
    after = [w for w in rep.waits if w.at.addr > last_mma]
    capsys.readouterr()
    assert sass.main([k.files["kernel.cubin"], "--kernel", "combine_mma", "-v"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "path" and lines[1].startswith("combine_mma_kernel")
    assert int(lines[1].split()[-1]) == rep.path and len(lines) == 2 + len(rep.waits)
    if pre == "0":
        assert [(w.loads[0].opcode, w.serial) for w in after] == [("LDG.E.U16", True)] * 4
        assert rep.path >= 10
    else:
        assert after == [] and rep.path <= 6
