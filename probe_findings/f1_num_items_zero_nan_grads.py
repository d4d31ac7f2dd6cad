"""Finding: a micro-batch whose labels are all ignored, with num_items_in_batch = 0 (what
transformers' Trainer passes when a whole accumulated batch has no target token, e.g.
completion-only SFT with a truncated response), gives NaN gradients in every parameter
patched; the unpatched model gives exactly zero gradients (only its loss is nan).
One optimizer step then turns the patched model's parameters into NaN for good.

Also reachable directly: codetta.ops.linear_cross_entropy(..., reduction="sum") with every
target ignored, divided by 0 (or any backward with an inf/nan grad_output)."""
import os, copy
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch, transformers, codetta

cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8)
torch.manual_seed(0)
ref = transformers.LlamaForCausalLM(cfg)
model = codetta.patch(copy.deepcopy(ref))
ids = torch.randint(0, 64, (1, 8))
labels = torch.full_like(ids, -100)  # no target token in this batch
for name, m in (("unpatched", ref), ("patched", model)):
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    loss = m(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(0)).loss
    loss.backward()
    nan_grads = [n for n, p in m.named_parameters() if p.grad.isnan().any()]
    opt.step()
    nan_params = [n for n, p in m.named_parameters() if p.isnan().any()]
    print(f"{name}: loss {loss.item()}, params with NaN grads {len(nan_grads)}, NaN params after step {len(nan_params)}")
# expected: both 0 NaN grads (grads exactly 0), 0 NaN params.

# the operator alone
x = torch.randn(8, 32, requires_grad=True)
w = torch.randn(64, 32, requires_grad=True)
t = torch.full((8,), -100)
loss = codetta.ops.linear_cross_entropy(x, w, t, reduction="sum") / 0.0
loss.backward()
x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
(torch.nn.functional.cross_entropy(x2 @ w2.t(), t, reduction="sum") / 0.0).backward()
print("op: codetta dx nan", x.grad.isnan().any().item(), "dw nan", w.grad.isnan().any().item(),
      "| torch dx nan", x2.grad.isnan().any().item(), "dw nan", w2.grad.isnan().any().item())
