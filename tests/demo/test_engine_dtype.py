"""#37 item 23: the demo extracts in float32 where the CPU would emulate bfloat16."""

from __future__ import annotations

import pytest

from speculators_vllm016.demo.engine_dtype import choose_engine_dtype

AVX2_ONLY = frozenset({"sse2", "sse4_2", "avx", "avx2", "fma"})


def test_a_cpu_without_native_bf16_extracts_in_float32_and_says_so_in_one_line():
    dtype, why = choose_engine_dtype("auto", AVX2_ONLY)
    assert dtype == "float32"
    assert why is not None and "\n" not in why and "float32" in why and "bfloat16" in why


@pytest.mark.parametrize("native", ["avx512f", "avx512_bf16", "amx_bf16"])
def test_a_cpu_with_native_bf16_keeps_vllms_choice_silently(native):
    assert choose_engine_dtype("auto", AVX2_ONLY | {native}) == ("auto", None)


def test_unknown_flags_or_another_architecture_change_nothing():
    assert choose_engine_dtype("auto", frozenset({"fp", "asimd", "bf16"})) == ("auto", None)


def test_a_dtype_the_user_asked_for_is_kept():
    assert choose_engine_dtype("bfloat16", AVX2_ONLY) == ("bfloat16", None)
    assert choose_engine_dtype("float32", AVX2_ONLY | {"amx_bf16"}) == ("float32", None)


def test_the_demo_hands_the_chosen_dtype_to_datagen_and_records_it(tmp_path, monkeypatch, capsys):
    """run_demo on a CPU without native bf16: the datagen stage gets float32 and its recorded
    options say so (a later run on a faster CPU extracts again). Stages are stubbed: only the
    hand-over is checked here; the demo's engine test runs the real stages."""
    import json

    from speculators_vllm016.data_generation import offline
    from speculators_vllm016.demo import engine_dtype, pipeline, target
    from speculators_vllm016.demo.options import DemoOptions

    monkeypatch.setattr(
        "speculators_vllm016.data_generation.cpu_defaults.cpu_vector_flags", lambda: AVX2_ONLY
    )
    seen = {}

    class Stop(Exception):
        pass

    def fake_datagen(options):
        seen["dtype"] = options.engine.dtype
        raise Stop

    monkeypatch.setattr(offline, "run_datagen", fake_datagen)
    monkeypatch.setattr(
        target,
        "train_demo_target",
        lambda *a, **k: type(
            "R", (), dict(tokens=1, tokens_per_second=1.0, first_loss=1.0, last_loss=1.0)
        )(),
    )
    monkeypatch.setattr(
        "speculators_vllm016.demo.build_demo_model", lambda path, conversations=None: path
    )
    with pytest.raises(Stop):
        pipeline.run_demo(DemoOptions(output_dir=str(tmp_path)))
    assert seen["dtype"] == "float32"
    state = json.loads((tmp_path / pipeline.STATE_FILE).read_text())
    assert state["datagen"]["options"]["dtype"] == "float32"
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "float32" in line] == [
        choose_engine_dtype("auto", AVX2_ONLY)[1]
    ]
    assert engine_dtype.ENGINE_DTYPES[0] == "auto"
