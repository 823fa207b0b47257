"""Requests and samples as raw tensors over a real gloo group (two ranks as two threads)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from speculators_vllm016.train.online.sample_transport import (
    DONE,
    REQUEST,
    SampleRequest,
    StepSamples,
    Transport,
)


def pair() -> tuple[Transport, Transport]:
    store = dist.HashStore()
    groups: dict[int, object] = {}

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return Transport(groups[0]), Transport(groups[1])


def sample(tokens: int, dtype: torch.dtype, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 1000, (tokens,), generator=generator),
        "loss_mask": torch.randint(0, 2, (tokens,), generator=generator),
        "hidden_states": [torch.randn(tokens, 8, generator=generator).to(dtype) for _ in range(4)],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_samples_arrive_bit_for_bit_with_their_positions_and_bytes_counted(dtype):
    extraction, training = pair()
    sent = {7: sample(5, dtype, 1), 2: sample(11, dtype, 2)}
    got: dict = {}

    def serve() -> None:
        request = extraction.next_request()
        got["request"] = request
        extraction.answer(request.source, StepSamples(samples=sent))

    server = threading.Thread(target=serve)
    server.start()
    training.request(0, SampleRequest(REQUEST, iteration=1, epoch=3, step=4))
    answer = training.receive_answer(0)
    server.join()
    assert got["request"] == SampleRequest(REQUEST, 1, 3, 4, source=1)
    assert answer.failure is None and sorted(answer.samples) == [2, 7]
    for index, original in sent.items():
        arrived = answer.samples[index]
        assert torch.equal(arrived["input_ids"], original["input_ids"])
        assert torch.equal(arrived["loss_mask"], original["loss_mask"])
        assert len(arrived["hidden_states"]) == 4
        for a, b in zip(arrived["hidden_states"], original["hidden_states"], strict=True):
            assert a.dtype == dtype and torch.equal(a, b)
    states = 16 * 4 * 8 * torch.empty(0, dtype=dtype).element_size()
    expected = 5 * 8 + 2 * 2 * 8 + 2 * 16 * 8 + states  # header, meta, ids + masks, states
    assert training.bytes_moved == extraction.bytes_moved == expected


def test_a_failure_carries_the_extraction_sides_words_and_done_is_a_request():
    extraction, training = pair()

    def serve() -> None:
        request = extraction.next_request()
        extraction.answer(request.source, StepSamples(failure="extraction rank 0: the engine died"))
        assert extraction.next_request().kind == DONE

    server = threading.Thread(target=serve)
    server.start()
    training.request(0, SampleRequest(REQUEST, step=0))
    assert training.receive_answer(0).failure == "extraction rank 0: the engine died"
    training.done(0)
    server.join(timeout=30)
    assert not server.is_alive()


def test_an_empty_step_is_an_empty_answer():
    extraction, training = pair()
    server = threading.Thread(
        target=lambda: extraction.answer(extraction.next_request().source, StepSamples())
    )
    server.start()
    training.request(0, SampleRequest(REQUEST))
    answer = training.receive_answer(0)
    server.join()
    assert answer.samples == {} and answer.failure is None


def _nccl_round_trip(rank: int, store_path: str, sent: dict, result_path: str) -> None:
    store = dist.FileStore(store_path, 2)
    torch.cuda.set_device(rank)
    control = dist.ProcessGroupGloo(
        dist.PrefixStore("control", store), rank, 2, datetime.timedelta(seconds=120)
    )
    payload = dist.ProcessGroupNCCL(
        dist.PrefixStore("payload", store), rank, 2, dist.ProcessGroupNCCL.Options()
    )
    transport = Transport(control, payload, torch.device("cuda", rank))
    if rank == 0:
        request = transport.next_request()
        transport.answer(request.source, StepSamples(samples=sent))
    else:
        transport.request(0, SampleRequest(REQUEST, step=1))
        torch.save(transport.receive_answer(0).samples, result_path)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
def test_hidden_states_travel_over_nccl_between_two_gpus_bit_for_bit(tmp_path):
    import torch.multiprocessing as mp

    sent = {3: sample(7, torch.bfloat16, 5)}
    result = tmp_path / "received.pt"
    mp.spawn(_nccl_round_trip, args=(str(tmp_path / "store"), sent, str(result)), nprocs=2)
    received = torch.load(result, weights_only=False)
    assert sorted(received) == [3]
    for a, b in zip(received[3]["hidden_states"], sent[3]["hidden_states"], strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b)
