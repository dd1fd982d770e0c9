"""Bytes per token of E4B, counted by the ISS on the compiled program, against a hand count."""

import pytest

from firmware.traffic import token_traffic
from hdl.config import PRESETS as HW
from sim.config import PRESETS


def int4_bytes(rows, cols, group=128):
    # INT4 two per byte plus one binary16 scale per (row, group of 128 columns).
    return rows * cols // 2 + rows * -(-cols // group) * 2


def test_e4b_weight_and_kv_bytes_match_a_hand_count():
    # E4B, written out by hand from the model's dimensions (not from the config module).
    D, F, L, q, kv, P, r, V = 2048, 16384, 35, 2048, 512, 256, 64, 262400
    per_layer = (int4_bytes(q, D) + int4_bytes(D, q) + int4_bytes(F, D) * 2 + int4_bytes(D, F)
                 + int4_bytes(r, D) + int4_bytes(D, r, group=64) + int4_bytes(P, D) + int4_bytes(D, P))
    kv_proj = 2 * int4_bytes(kv, D)
    weights = L * per_layer + 20 * kv_proj                      # layers 20..34 reuse layers 18/19's K/V
    weights += int4_bytes(V, D) + int4_bytes(35 * P, D) + 6 * int4_bytes(D, D)   # LM head, PLE proj, AltUp
    weights += D // 2 + D // 128 * 2 + 35 * P // 2 + 35 * P // 128 * 2          # gathered rows
    # Sparse layers 0..9 fetch only the W_down columns of the 5 % surviving activations, and only the W_up rows
    # (INT4 row and its group-128 scales) of the 5 % surviving gate units, counted per up piece (F/4 three times,
    # F/4 - F/32, F/32: each masked WGEMV keeps round(rows * 0.05)).
    kept = round(F * 0.05)
    skipped = 10 * (F - kept) * D // 2
    up_rows = sum(n - round(n * 0.05) for n in (F // 4, F // 4, F // 4, F // 4 - F // 32, F // 32))
    skipped += 10 * up_rows * (D // 2 + D // 128 * 2)
    res = token_traffic(PRESETS["e4b"], HW["kv260"], [128, 1024, 4096])
    planes = token_traffic(PRESETS["e4b"], HW["kv260"].replace(kv_v_layout="planes"), [128, 1024, 4096])
    assert HW["kv260"].kv_v_layout == "rows"
    for pos, c in res.items():
        assert c.weight_bytes_skipped == skipped
        assert c.bytes_read["WEIGHTS"] == weights - skipped
        # Window-aware KV reads: 7 full layers see pos + 1 positions, 28 sliding layers min(pos + 1, 512).
        # The INT8 cache (docs/numerics.md): per KV head (2 per layer; the GEMV engine's four vectors take the
        # 4 query heads of its group at once) K's two planes of 128 bytes and their 2 x 2 binary16 scales per
        # position (a scale per activation block of 128, kv260's, in each plane). V per chunk of positions (one per layer, two in a sliding layer whose window wraps past the
        # end of its ring of 512 + 3 rows, from slot (pos - 511) mod 515 on), by the preset's V layout:
        # "rows" (kv260): per KV head one byte in each of V's 256 rows per position and the chunk's table of
        # 256 binary16 row scales; per query head (8 per layer) its binary16 V scale per position.
        # "planes": per query head V's two planes of 128 bytes and its binary16 row scale per position, and
        # the planes' scale table (2 x 256 binary16) per chunk.
        seen = 7 * (pos + 1) + 28 * min(pos + 1, 512)
        chunks = 35 + (28 if pos >= 512 and (pos - 511) % 515 + 512 > 515 else 0)
        assert chunks == {128: 35, 1024: 63, 4096: 63}[pos]
        k_bytes = 2 * seen * (2 * 128 + 2 * 2 * 2)
        assert c.bytes_read["KV"] == k_bytes + 2 * (seen * 256 + chunks * 256 * 2) + 8 * seen * 2
        assert planes[pos].bytes_read["KV"] == k_bytes + 8 * (seen * (2 * 128 + 2) + chunks * 2 * 256 * 2)
        # per cache layer and KV head: K's two plane rows of 128 bytes, V's 256 bytes, 4 K scales, 1 V scale
        assert c.bytes_written["KV"] == 20 * 2 * (4 * 128 + 4 * 2 + 2)
        assert c.bytes_written["LOGITS"] == V * 4
    # The hand count of docs/requirements.md: INT4 AltUp with the W_down skip streams 2,108 MB at L = 128 with
    # per-row scales; group-128 scales add 1/64 of a byte per weight; the W_up row skip takes 164 MB off.
    total = res[128].total_read() + sum(res[128].bytes_written.values())
    assert total / 1e6 == pytest.approx(2108 + 0.031 * 1971 - 164.4, rel=0.01)


def test_cli_json(capsys):
    import json

    from firmware.traffic import main
    assert main(["--model", "tiny", "--hw", "tiny", "--positions", "3", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    hw = HW["tiny"]
    assert (out["model"], out["hw"], out["clock_hz"], out["peak_bytes_per_s"]) == \
        ("tiny", "tiny", hw.clock_hz, hw.peak_weight_bytes_per_second)
    res = token_traffic(PRESETS["tiny"], hw, [3, 7])
    assert [p["position"] for p in out["positions"]] == [3, 7]
    for got, (pos, c) in zip(out["positions"], res.items()):
        total = c.total_read() + sum(c.bytes_written.values())
        assert got["bytes_per_token"] == total and got["bytes_read"] == dict(c.bytes_read)
        assert got["weight_bytes"] == c.bytes_read["WEIGHTS"] and got["kv_read_bytes"] == c.bytes_read["KV"]
        assert got["roofline_tok_s"] == pytest.approx(hw.peak_weight_bytes_per_second / total)
