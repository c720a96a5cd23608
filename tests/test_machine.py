"""The CPU a figure was made on, read from the kernel's cpuinfo."""

from comera_convert import machine


def test_the_vendor_model_and_timing_features_are_read_from_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n"
                    "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    monkeypatch.setattr(machine, "CPU_INFO", str(info))
    assert machine.cpu_vendor() == "AuthenticAMD"
    assert machine.cpu_model() == "AMD EPYC 9R14"
    assert machine.cpu_description() == "AMD EPYC 9R14 (avx2, avx512f, avx512_bf16)"
