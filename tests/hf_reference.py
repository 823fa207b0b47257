"""Reference hidden states from Hugging Face transformers, run on the same weights as vLLM."""

from __future__ import annotations

from pathlib import Path

import torch


class HFReference:
    """Runs a checkpoint in transformers (fp32) and returns each decoder layer's output stream.

    A hook on every decoder layer reads the residual stream the layer hands on, which for the last
    layer is the value before the final norm, as the generator captures it.
    """

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
        self.model.eval()
        self.layers = self.model.model.layers

    @torch.no_grad()
    def streams(self, ids: list[int], layer_ids: list[int]) -> list[torch.Tensor]:
        captured: dict[int, torch.Tensor] = {}
        handles = []
        for index in layer_ids:

            def hook(module, args, output, index=index):
                value = output[0] if isinstance(output, tuple) else output
                captured[index] = value[0].detach().clone()

            handles.append(self.layers[index].register_forward_hook(hook))
        try:
            self.model(torch.tensor([ids]), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return [captured[index] for index in layer_ids]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual = actual.to(torch.float64)
    expected = expected.to(torch.float64)
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def mixed_batch(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


# Relative error allowed between vLLM's captured states and transformers' in float32.
TOLERANCE = 1e-4


def assert_matches_reference(results, batch, reference, layer_ids, tolerance=TOLERANCE):
    """The generator's `results` for `batch` are, sample by sample and layer by layer, the
    reference's streams: in order, with their input ids, shapes and within `tolerance`."""
    assert len(results) == len(batch)
    for index, (result, ids) in enumerate(zip(results, batch)):
        assert result["input_ids"].dtype == torch.long
        assert result["input_ids"].tolist() == ids, f"sample {index} came back out of order"
        assert result["loss_mask"] is None
        expected = reference.streams(ids, layer_ids)
        assert len(result["hidden_states"]) == len(layer_ids)
        for layer, got, want in zip(layer_ids, result["hidden_states"], expected):
            assert got.shape == want.shape, f"sample {index} layer {layer}"
            error = relative_error(got, want)
            assert error <= tolerance, f"sample {index} layer {layer}: relative error {error:.2e}"
