"""Tensors on a GPU other than the current one (a model moved to cuda:1, layers spread over GPUs
by a device map): Triton launches on the current device, so codetta makes the tensors' device
current for its launches. Checked against eager PyTorch on the same GPU: a GEMM with an
epilogue, a row kernel, and a patched model's loss and gradients. Needs two GPUs."""

import copy

import pytest
import torch

import codetta
from codetta import epilogue as ep

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs")
transformers = pytest.importorskip("transformers")

OTHER = torch.device("cuda", 1)


@pytest.fixture(autouse=True)
def _first_gpu_current():
    previous = torch.cuda.current_device()
    torch.cuda.set_device(0)
    yield
    torch.cuda.set_device(previous)


def test_gemm_with_an_epilogue_and_a_row_kernel_run_on_the_tensors_gpu():
    a = torch.randn(300, 136, device=OTHER, dtype=torch.bfloat16)
    b = torch.randn(136, 200, device=OTHER, dtype=torch.bfloat16)
    r = torch.randn(300, 200, device=OTHER, dtype=torch.bfloat16)
    p = ep.Program("residual_add_sumsq")
    x = p.acc + p.aux("residual")
    p.store("out", x)
    p.row_sumsq("ss", x)
    out = codetta.gemm(a, b, p, residual=r)
    assert out["out"].device == OTHER and torch.cuda.current_device() == 0
    expected = a.double() @ b.double() + r.double()
    torch.testing.assert_close(out["out"].double(), expected, rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(out["ss"].double(), (expected * expected).sum(1), rtol=1e-2, atol=1.0)

    x = torch.randn(77, 96, device=OTHER, requires_grad=True)
    g = torch.rand(96, device=OTHER, requires_grad=True)
    y = codetta.ops.rms_norm(x, g, 1e-6)
    x_ref, g_ref = x.detach().double().requires_grad_(), g.detach().double().requires_grad_()
    y_ref = torch.nn.functional.rms_norm(x_ref, (96,), g_ref, 1e-6)
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    y_ref.backward(dy.double())
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(g.grad.double(), g_ref.grad, rtol=1e-4, atol=1e-4)


def test_patched_model_on_the_second_gpu_matches_its_own_forward():
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(OTHER).float().train()
    patched = codetta.patch(copy.deepcopy(model))
    ids = torch.randint(0, 96, (2, 33), device=OTHER)
    losses = []
    for m in (model, patched):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-4, msg=name)
