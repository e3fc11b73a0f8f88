"""benchmarks/context_scale.py at a small size on `tiny`: every arm is the tier it names (the history
hits device, host and storage in full where it should, the cold turn hits nothing), and both tables
print a row per history. No figure is asserted: these are not timings."""

from __future__ import annotations

from benchmarks import context_scale as cs


def test_each_arm_hits_the_tier_it_names(tmp_path):
    history, turn = 256, 64
    row = cs.measure_history("tiny", history, turn, steps=2, store=str(tmp_path))
    assert row.arms["cold"].cached == {"device": 0, "host": 0, "storage": 0}
    for tier in ("device", "host", "storage"):
        assert row.arms[tier].cached == {t: (history if t == tier else 0) for t in ("device", "host", "storage")}
    assert row.kv_bytes_per_step > 0 and row.decode_step_s > 0


def test_decode_only_decodes_after_the_history_on_device(tmp_path):
    history, turn = 256, 64
    row = cs.measure_history("tiny", history, turn, steps=2, store=str(tmp_path), decode_only=True)
    assert set(row.arms) == {"history", "device"}
    assert row.arms["device"].cached == {"device": history, "host": 0, "storage": 0}
    assert row.kv_bytes_per_step > 0 and row.decode_step_s > 0


def test_tables_have_a_row_per_history(capsys):
    arm = cs.Arm(0.5, {"device": 0, "host": 0, "storage": 0})
    rows = [cs.Row(h, dict.fromkeys(("history", "cold", "device", "host", "storage"), arm), 0.01, 1 << 20, 1 << 10)
            for h in (1024, 4096)]  # fmt: skip
    cs.print_table(rows, "tiny", 1024, copy_gbps=10.0)
    out = capsys.readouterr().out
    assert out.count("\n| 1024 |") == 2 and out.count("\n| 4096 |") == 2
    decode_only = [cs.Row(1024, dict.fromkeys(("history", "device"), arm), 0.01, 1 << 20, 1 << 10)]
    cs.print_table(decode_only, "tiny", 1024, copy_gbps=10.0)
    assert capsys.readouterr().out.count("\n| 1024 |") == 1  # the decode table only
