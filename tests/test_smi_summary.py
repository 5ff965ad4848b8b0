"""benchmarks/smi_summary.py (CPU): the clock / power log's summary that validate_pending.sh prints."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import smi_summary  # noqa: E402


def test_summary_of_samples_and_reasons():
    log = ["2026/12/05 22:00:00.000, 1980, 2619, 450.5, 55, 0x0000000000000000",
           "2026/12/05 22:00:00.200, 1755, 2619, 690.0, 61, 0x0000000000000004",
           "2026/12/05 22:00:00.400, 1830, 2619, 700.0, 62, 0x0000000000000024",
           "Field \"clocks_event_reasons.active\" is not a valid field to query.",
           ""]
    s = smi_summary.summarise(log)
    assert s["rows"] == 3
    assert s["sm MHz"] == (1755.0, 1830.0, 1980.0)
    assert s["power W"] == (450.5, 690.0, 700.0)
    assert s["reasons"] == {"sw_power_cap": 0.667, "sw_thermal": 0.333}


def test_summary_without_samples():
    assert smi_summary.summarise(["Failed to initialize NVML"]) == {"reasons": {}, "rows": 0}


def test_main_prints_one_line(tmp_path, monkeypatch, capsys):
    log = tmp_path / "smi.csv"
    log.write_text("2026/12/05 22:29:26.750, 345, 3201, 81.66, 38, 0x0000000000000001\n"
                   "2026/12/05 22:29:26.957, 1980, 3201, 650.5, 52, 0x0000000000000000\n")
    monkeypatch.setattr(smi_summary.sys, "argv", ["smi_summary.py", str(log)])
    smi_summary.main()
    out = capsys.readouterr().out
    assert out.startswith("smi (2 samples, min / median / max): sm MHz 345 / 1162.5 / 1980;")
    assert out.rstrip().endswith("clock-event reasons active: idle 50%")
