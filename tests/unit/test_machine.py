"""benchmarks/common.py's machine record: the CPU parsed from a fixed /proc/cpuinfo text (an
AVX-512/bf16 Zen 4 and this project's AVX2-only Zen 1 KVM host, the two on which the
onona-jax vs torch.compile ranking flips), its one-line rendering, and `common.run`'s header,
footer and JSON record."""

import json
import os
import sys

import pytest
from absl import flags

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # the scripts import common.py from beside them
import common  # noqa: E402

# /proc/cpuinfo's first processor of a KVM guest on an AMD EPYC 9654 (Genoa, Zen 4); the
# second processor's block differs only in its numbers and is not read.
ZEN4 = """\
processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 17
model name	: AMD EPYC 9654 96-Core Processor
stepping	: 1
cpu MHz		: 2396.398
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm rep_good nopl cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext invpcid_single ssbd ibrs ibpb stibp vmmcall fsgsbase bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx512_bf16 clzero xsaveerptr wbnoinvd arat avx512vbmi umip pku ospke avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid fsrm
bogomips	: 4792.79

processor	: 1
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 17
model name	: AMD EPYC 9654 96-Core Processor
flags		: fpu
"""

# This host's: AMD EPYC family 23 model 1 (Naples, Zen 1) under KVM, named only "AMD EPYC".
ZEN1 = """\
processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 23
model		: 1
model name	: AMD EPYC
stepping	: 2
flags		: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology nonstop_tsc cpuid extd_apicid tsc_known_freq pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy cr8_legacy abm sse4a misalignsse 3dnowprefetch osvw topoext ssbd ibpb vmmcall fsgsbase tsc_adjust bmi1 avx2 smep bmi2 rdseed adx smap clflushopt sha_ni xsaveopt xsavec xgetbv1 clzero xsaveerptr virt_ssbd arat
bogomips	: 3992.50
"""


def test_parse_cpuinfo_zen4_and_zen1():
    assert common.parse_cpuinfo(ZEN4) == {
        "cpu": "AMD EPYC 9654 96-Core Processor", "vendor": "AuthenticAMD", "family": 25, "model": 17,
        "isa": ["avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni"], "virtualized": True}
    assert common.parse_cpuinfo(ZEN1) == {
        "cpu": "AMD EPYC", "vendor": "AuthenticAMD", "family": 23, "model": 1, "isa": ["avx2", "fma"],
        "virtualized": True}
    # an Intel Sapphire Rapids' AMX and AVX-VNNI, on bare metal; an ARM cpuinfo names no x86 fields
    spr = "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\nflags\t\t: avx2 fma avx512f amx_tile amx_int8 amx_bf16 avx_vnni\n"
    assert common.parse_cpuinfo(spr)["isa"] == ["avx2", "fma", "avx512f", "avx_vnni", "amx_bf16", "amx_tile", "amx_int8"]
    assert common.parse_cpuinfo(spr)["virtualized"] is False
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n"
    assert common.parse_cpuinfo(arm) == {"cpu": None, "vendor": None, "family": None, "model": None, "isa": [],
                                         "virtualized": False}


def test_parse_lscpu_and_meminfo():
    lscpu = "Model name:                              AMD EPYC\nHypervisor vendor:                       KVM\n"
    assert common.parse_lscpu_hypervisor(lscpu) == "KVM"
    assert common.parse_lscpu_hypervisor("Model name: AMD EPYC\n") is None
    assert common.parse_meminfo_gib("MemTotal:       24683664 kB\nMemFree: 1 kB\n") == 23.54


def _machine(cpuinfo, **extra):
    m = common.parse_cpuinfo(cpuinfo)
    m.pop("virtualized")
    return {**m, "cores": 2, "cpu_count": 2, "hypervisor": "KVM", "memory_gib": 23.54, "load_before": [0.3, 0.5, 0.7],
            "jax": "0.10.2", "jaxlib": "0.10.2", "torch": "2.13.0+cpu", **extra}


def test_machine_line():
    assert common.machine_line(_machine(ZEN1)) == (
        "AMD EPYC (family 23 model 1) · avx2 fma, no avx512 · 2 cores · KVM · 23.5 GiB · load 0.30 · "
        "jax 0.10.2 jaxlib 0.10.2 torch 2.13.0+cpu")
    assert common.machine_line(_machine(ZEN4, cores=8, cpu_count=192, hypervisor=None, torch=None, backend="cpu",
                                        device="cpu")) == (
        "AMD EPYC 9654 96-Core Processor (family 25 model 17) · avx2 fma avx512f avx512_bf16 avx512_vnni · "
        "8 of 192 cores · 23.5 GiB · load 0.30 · jax 0.10.2 jaxlib 0.10.2 · jax backend cpu")


def test_machine_of_this_host():
    m = common.machine()
    assert m["cores"] == len(os.sched_getaffinity(0)) and m["cpu_count"] == os.cpu_count()
    assert set(m["isa"]) <= set(common.GEMM_FLAGS) and len(m["load_before"]) == 3
    assert m["jax"] is not None and m["python"] == ".".join(map(str, sys.version_info[:3]))
    assert m["backend"] == "cpu"  # jax is imported here (conftest): its backend is recorded


def test_run_prints_the_machine_and_records_it(capsys, tmp_path):
    out = tmp_path / "r.json"

    def define(fv, argv):
        flags.DEFINE_integer("n", 1, "", flag_values=fv)

    def main(fv, rest):
        out.write_text(json.dumps({"n": fv.n, "machine": common.record()}))

    assert common.run(define, main, ["--n=3"], "doc") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "machine: " + common.machine_line(common.MACHINE)
    assert lines[-1].startswith("load average (1/5/15 min) after ") and len(lines) == 2
    res = json.loads(out.read_text())
    assert res["n"] == 3 and len(res["machine"]["load_after"]) == 3
    assert {k: v for k, v in res["machine"].items() if k != "load_after"} == common.MACHINE

    # a script whose stdout is JSON: the lines go to stderr; a failure still prints the load after
    def fail(fv, rest):
        raise common.cli.Failure("broke")

    assert common.run(define, fail, [], "doc", json_stdout=True) == 1
    cap = capsys.readouterr()
    err = cap.err.splitlines()
    assert cap.out == "" and len(err) == 3, cap
    assert err[0].startswith("machine: ") and err[1].startswith("load average") and err[2] == "error: broke"


def test_record_outside_run_is_an_error(monkeypatch):
    monkeypatch.setattr(common, "MACHINE", {})
    with pytest.raises(RuntimeError, match="outside common.run"):
        common.record()
