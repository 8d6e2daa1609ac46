"""SAMPLE (protocol 2.7): a teacher's own responses, checked against a plain decoding loop.

The reference decodes greedily with a full forward per token (no KV cache, no `generate`),
so the server's batching, left padding, n-per-prompt order and stop handling are all
checked against something that shares none of them.
"""

from __future__ import annotations

import pytest
import torch

from opd.teachers.client import TeacherClient, TeacherError
from opd.teachers.hf_backend import HFBackend
from opd.teachers.protocol import ErrorCode, Sample, decode, encode
from opd.teachers.server import ServerLimits, serving_in_thread

PROMPTS = [[5, 17, 99, 3], [200, 1], [42, 42, 42, 42, 42, 7, 8]]


@pytest.fixture(scope="module")
def backend(tiny_teacher_dir):
    return HFBackend(tiny_teacher_dir, max_k=8, max_positions=64)


@pytest.fixture(scope="module")
def client(backend):
    with serving_in_thread(backend, limits=ServerLimits(max_tokens_per_request=200)) as server:
        c = TeacherClient(server.address, timeout_s=30)
        yield c
        c.close()


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_samples_equal_a_plain_decoding_loop_n_per_prompt_in_order(client, backend):
    out = client.sample(PROMPTS, n=2, max_new_tokens=6, temperature=0.0, stop_ids=[])
    assert len(out.responses) == 2 * len(PROMPTS) and out.finish == ["length"] * 6
    for b, prompt in enumerate(PROMPTS):
        want = greedy(backend.model, prompt, 6)
        assert out.responses[2 * b] == want and out.responses[2 * b + 1] == want


def test_a_response_ends_after_its_first_stop_id(client, backend):
    free = greedy(backend.model, PROMPTS[0], 6)
    stop = free[2]
    first = free.index(stop)
    out = client.sample(PROMPTS[:1], max_new_tokens=6, temperature=0.0, stop_ids=[stop])
    assert out.responses == [free[:first + 1]] and out.finish == ["stop"]


def test_the_same_seed_gives_the_same_samples_and_another_seed_others(client):
    kw = dict(n=4, max_new_tokens=8, temperature=1.0, stop_ids=[])
    a, b = client.sample(PROMPTS, seed=3, **kw), client.sample(PROMPTS, seed=3, **kw)
    c = client.sample(PROMPTS, seed=4, **kw)
    assert a.responses == b.responses and a.responses != c.responses
    assert len({tuple(r) for r in a.responses}) > len(PROMPTS)   # the n of a prompt differ
    assert all(len(r) == 8 for r in a.responses)


def test_a_request_over_the_budget_goes_in_parts_and_comes_back_as_one(client, backend):
    # 3 prompts x (len + 2 x 30) tokens > 200: two requests, joined in prompt order.
    out = client.sample(PROMPTS, n=2, max_new_tokens=30, temperature=0.0, stop_ids=[])
    assert [len(r) for r in out.responses] == [30] * 6
    assert out.responses[4] == greedy(backend.model, PROMPTS[2], 30)


@pytest.mark.parametrize("fields, code", [
    (dict(n=0), ErrorCode.BAD_REQUEST),
    (dict(top_p=0.0), ErrorCode.BAD_REQUEST),
    (dict(temperature=-1.0), ErrorCode.BAD_REQUEST),
    (dict(max_new_tokens=70), ErrorCode.TOO_LONG),          # the model takes 64 positions
    (dict(n=8, max_new_tokens=30), ErrorCode.TOO_LONG),     # over max_tokens_per_request
    (dict(stop_ids=[260]), ErrorCode.BAD_TOKEN),
])
def test_a_bad_sample_request_gets_its_error(backend, fields, code):
    import zmq

    with serving_in_thread(backend, limits=ServerLimits(max_tokens_per_request=200)) as server:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(server.address)
        try:
            ids = torch.tensor(PROMPTS[0], dtype=torch.int32)
            sock.send_multipart(encode(Sample(request_id=1, **{"max_new_tokens": 8, **fields}), (ids, torch.tensor([0, 4], dtype=torch.int32))))
            assert sock.poll(10_000)
            msg, _ = decode(sock.recv_multipart())
        finally:
            sock.close(linger=0)
    assert msg.code == code, msg


def test_a_teacher_that_does_not_sample_is_refused_by_the_client(tiny_teacher_dir):
    backend = HFBackend(tiny_teacher_dir, max_k=8, max_positions=64)
    backend.modes = ("topk", "full")   # as a server before protocol 2.7 says
    with serving_in_thread(backend) as server:
        with TeacherClient(server.address, timeout_s=10) as c:
            with pytest.raises(TeacherError, match="does not sample"):
                c.sample(PROMPTS)
