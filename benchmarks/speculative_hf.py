"""Time the `hf` engine of `speculators eval` against the no-cache reference and plain greedy.

On the same prompts, interleaved repeats of: (a) `speculative_generate` batched (the draft's own
KV cache, all rows in one draft pass), (a0) the same with the draft rerun over each prompt's
whole history (`cached_draft=False`, the engine before the draft cache), (b) batched draft one
prompt at a time, (c) `SpeculatorModel.generate` (the reference loop without a verifier KV
cache), (d) transformers' greedy `generate` with no draft. Prints median seconds, spread
(min-max), tokens/s, the ratios a0/a, c/a and d/a, and the load average before and after (the
machine may be shared). The models are built locally (a tiny Llama and an untrained EAGLE-3 draft), so
acceptance is near zero: this measures the loop's cost, not a draft's benefit.

    OMP_NUM_THREADS=1 python benchmarks/speculative_hf.py --prompts 8 --new-tokens 48 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, LlamaConfig

    from speculators_vllm016.config import SpeculatorsConfig, VerifierConfig
    from speculators_vllm016.evaluate.speculative import speculative_generate
    from speculators_vllm016.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators_vllm016.proposals import GreedyTokenProposalConfig
    from speculators_vllm016.tiny_models import build_tiny_llama
    from speculators_vllm016.train.vocab_mapping import build_vocab_mappings_from_distribution

    folder = Path(tempfile.mkdtemp(prefix="speculative_hf_"))
    path = build_tiny_llama(folder / "llama")
    verifier = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    layer = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        num_hidden_layers=1,
        vocab_size=512,
    )
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=128,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(path), architectures=["LlamaForCausalLM"]),
        ),
    )
    d2t, t2d = build_vocab_mappings_from_distribution({t: 512 - t for t in range(512)}, 128, 512)
    torch.manual_seed(0)
    draft = Eagle3DraftModel(config, t2d=t2d, d2t=d2t).eval()
    prompts = [
        [0] + [(7 * i + j) % 500 + 5 for j in range(40 + 3 * i)] for i in range(args.prompts)
    ]
    n = args.new_tokens

    def batched() -> None:
        speculative_generate(verifier, draft, prompts, n, 3, batch_size=args.batch_size)

    def uncached_draft() -> None:
        speculative_generate(
            verifier, draft, prompts, n, 3, batch_size=args.batch_size, cached_draft=False
        )

    def one_by_one() -> None:
        speculative_generate(verifier, draft, prompts, n, 3, batch_size=1)

    def reference() -> None:
        if draft.verifier_attachment_mode != "full":
            if draft.verifier_attachment_mode != "detached":
                draft.detach_verifier()
            draft.attach_verifier(verifier, mode="full")
        for prompt in prompts:
            draft.generate(torch.tensor([prompt]), max_new_tokens=n, num_speculative_tokens=3)

    def greedy() -> None:
        for prompt in prompts:
            verifier.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=1,
            )

    paths = {
        "a_batched": batched,
        "a0_uncached_draft": uncached_draft,
        "b_one_by_one": one_by_one,
        "c_reference_generate": reference,
        "d_greedy_no_draft": greedy,
    }
    print(f"load before: {os.getloadavg()}  threads: {torch.get_num_threads()}")
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, run in paths.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    tokens = n * len(prompts)
    for name, values in times.items():
        print(
            f"{name:22s} median {medians[name]:7.2f} s  spread {min(values):.2f}-{max(values):.2f} s  "
            f"{tokens / medians[name]:7.1f} tok/s  runs {[round(v, 2) for v in values]}"
        )
    print(f"load after: {os.getloadavg()}")
    print(
        f"a0/a = {medians['a0_uncached_draft'] / medians['a_batched']:.2f}  c/a = {medians['c_reference_generate'] / medians['a_batched']:.2f}  "
        f"d/a = {medians['d_greedy_no_draft'] / medians['a_batched']:.2f}"
    )


if __name__ == "__main__":
    main()
