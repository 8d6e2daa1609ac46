import torch

from opd.optim import adamw


def test_adamw_is_fused_on_cpu_and_takes_the_per_tensor_loops_steps():
    torch.manual_seed(0)
    params = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    twins = [p.detach().clone().requires_grad_(True) for p in params]
    opt = adamw(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    loop = torch.optim.AdamW(twins, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, foreach=False)
    assert opt.defaults["fused"] is True
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for ps, o in ((params, opt), (twins, loop)):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            o.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    # a device without the fused kernel gets torch's default implementation
    assert adamw([torch.zeros(2, device="meta", requires_grad=True)], lr=1.0).defaults["fused"] is None
