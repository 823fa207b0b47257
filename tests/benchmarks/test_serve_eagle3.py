"""benchmarks/serve_eagle3.py: its arguments, its report, and when it refuses to start (its runs
are engine work: the result file in benchmarks/results/ is one)."""

from __future__ import annotations

import pytest

from benchmarks import serve_eagle3


@pytest.fixture()
def draft(tmp_path):
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_help_names_every_user_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve_eagle3.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--target", "--draft", "--num-speculative-tokens", "--no-baseline", "--json"):
        assert flag in text
    assert "--result-file" not in text  # the child's flags stay hidden


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-speculative-tokens", "0"], "--num-speculative-tokens must be at least 1, got 0"),
        (["--num-prompts", "0"], "--num-prompts, --max-new-tokens and --repeats must be at least"),
        (["--repeats", "0"], "--num-prompts, --max-new-tokens and --repeats must be at least"),
        (["--data-path", "/nonexistent/chat.jsonl"], "--data-path /nonexistent/chat.jsonl does"),
        (["--prompts-file", "/nonexistent/prompts.txt"], "does not exist"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(extra, message, draft, capsys):
    assert serve_eagle3.main(["--target", "t", "--draft", str(draft), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0]


def test_a_folder_without_config_is_refused(tmp_path, capsys):
    assert serve_eagle3.main(["--target", "t", "--draft", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_an_empty_prompts_file_is_refused(tmp_path, draft, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n  \n")
    assert (
        serve_eagle3.main(["--target", "t", "--draft", str(draft), "--prompts-file", str(prompts)])
        == 2
    )
    assert "holds no prompt" in capsys.readouterr().err


def test_with_cpu_speculation_switched_off_it_stops_before_any_engine(draft, capsys, monkeypatch):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("checks vLLM's CPU build")
    started = []
    monkeypatch.setattr(serve_eagle3, "_child", lambda *a: started.append(a))
    monkeypatch.setenv("SPECULATORS_CPU_SPECULATION", "0")
    assert serve_eagle3.main(["--target", "t", "--draft", str(draft)]) == 2
    err = capsys.readouterr().err
    assert "CPU build refuses speculative decoding" in err and "SPECULATORS_CPU_SPECULATION" in err
    assert started == []


def test_on_the_cpu_build_it_starts_both_runs(draft, monkeypatch, capsys):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("checks vLLM's CPU build")
    monkeypatch.delenv("SPECULATORS_CPU_SPECULATION", raising=False)
    started = []

    def child(argv, mode, folder, index=0):
        started.append((mode, index))
        return {
            "generated_tokens": 8,
            "seconds": [1.0],
            "outputs": [[1]],
            "num_drafts": 2,
            "tau": 2.0,
            "per_position": [0.5],
        }

    monkeypatch.setattr(serve_eagle3, "_child", child)
    argv = ["--target", "t", "--draft", str(draft), "--draft", str(draft)]
    assert serve_eagle3.main(argv) == 0
    assert started == [("speculative", 0), ("speculative", 1), ("baseline", 0)]
    assert capsys.readouterr().out.count(f"draft {draft}:") == 2


def test_prompts_cycle_through_the_file(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\n\nb\n")
    assert serve_eagle3.load_prompts(prompts, 5) == ["a", "b", "a", "b", "a"]
    assert len(serve_eagle3.load_prompts(None, 3)) == 3


def test_report_of_both_runs():
    speculative = {
        "generated_tokens": 300,
        "seconds": [1.5, 1.0, 3.0],
        "num_drafts": 100,
        "tau": 2.5,
        "per_position": [0.8, 0.5, 0.2],
        "outputs": [[1, 2], [3, 4], [5]],
    }
    baseline = {"generated_tokens": 300, "seconds": [3.0], "outputs": [[1, 2], [3, 9], [5]]}
    assert serve_eagle3.report(speculative, baseline) == [
        "EAGLE-3: 100 drafts, tau 2.5000",
        "acceptance per position: 1: 0.800, 2: 0.500, 3: 0.200",
        "with draft: 300 tokens, median 200.0 tokens/s (range 100.0-300.0, 3 repeats)",
        "without:    300 tokens, median 100.0 tokens/s (range 100.0-100.0, 1 repeats)",
        "speed-up 2.00x (medians); identical outputs 2/3",
    ]
    assert len(serve_eagle3.report(speculative, None)) == 3
