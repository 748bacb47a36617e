"""ValveProbe: forward hooks that measure the four numerical valves of the source article.

1. input norms: RMS of what goes into each block's attention/MLP norm, and of what comes out;
2. the residual stream: RMS of x_l after every block (x_0 = the embeddings);
3. the final norm: RMS just before and just after it;
4. the LM-head softmax: logit max / min / log-sum-exp, entropy and top-1 probability.

Hooks only read tensors and write into preallocated fp32 buffers (copy_, no Python lists that grow,
no .item()), so they can stay attached to a compiled model and leave its logits bit-identical.
Per-token statistics are averaged over the positions of the last forward; the softmax statistics
are those of the last position (the distribution the next token is drawn from).
"""

from __future__ import annotations

import torch

from ..model.layers import Transformer


def _rms(x: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of each token's RMS over the hidden dimension (fp32)."""
    x = x.float()
    return x.pow(2).mean(-1).sqrt().mean()


class ValveProbe:
    def __init__(self, model: Transformer):
        L = model.config.num_layers
        self.model = model
        self.resid = torch.zeros(L + 1)  # RMS of x_0 (embeddings) .. x_L (after the last block)
        self.resid_absmax = torch.zeros(L + 1)
        self.attn_norm_in = torch.zeros(L)
        self.attn_norm_out = torch.zeros(L)
        self.mlp_norm_in = torch.zeros(L)
        self.mlp_norm_out = torch.zeros(L)
        self.final_in = torch.zeros(())
        self.final_out = torch.zeros(())
        # logit max, min, log-sum-exp, entropy (nats), top-1 probability, at the last position
        self.softmax = torch.zeros(5)
        self._handles = []
        self._hook(model.embed, self._resid_hook(0))
        for i, block in enumerate(model.layers):
            self._hook(block, self._resid_hook(i + 1))
            self._hook(block.attn_norm, self._norm_hook(self.attn_norm_in, self.attn_norm_out, i))
            self._hook(block.mlp_norm, self._norm_hook(self.mlp_norm_in, self.mlp_norm_out, i))
        self._hook(model.final_norm, self._final_hook)
        self._hook(model.lm_head, self._logits_hook)

    def _hook(self, module, fn):
        self._handles.append(module.register_forward_hook(fn))

    def _resid_hook(self, i):
        def hook(_module, _inputs, out):
            self.resid[i].copy_(_rms(out))
            self.resid_absmax[i].copy_(out.detach().abs().max())
        return hook

    @staticmethod
    def _norm_hook(into, out_buf, i):
        def hook(_module, inputs, out):
            into[i].copy_(_rms(inputs[0]))
            out_buf[i].copy_(_rms(out))
        return hook

    def _final_hook(self, _module, inputs, out):
        self.final_in.copy_(_rms(inputs[0]))
        self.final_out.copy_(_rms(out))

    def _logits_hook(self, _module, _inputs, out):
        z = out[:, -1].detach().float()  # (B, V): the next-token logits, in fp32 as sampling sees them
        logp = torch.log_softmax(z, dim=-1)
        p = logp.exp()
        stats = torch.stack([z.max(-1).values, z.min(-1).values, torch.logsumexp(z, -1),
                             -(p * logp).sum(-1), p.max(-1).values], dim=-1)  # (B, 5)
        self.softmax.copy_(stats.mean(0))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def summary(self) -> dict:
        """The measurements of the last forward as plain Python numbers."""
        names = ("logit_max", "logit_min", "logsumexp", "entropy", "top1_prob")
        return {"residual_rms": self.resid.tolist(), "residual_absmax": self.resid_absmax.tolist(),
                "attn_norm_in": self.attn_norm_in.tolist(), "attn_norm_out": self.attn_norm_out.tolist(),
                "mlp_norm_in": self.mlp_norm_in.tolist(), "mlp_norm_out": self.mlp_norm_out.tolist(),
                "final_norm_in": float(self.final_in), "final_norm_out": float(self.final_out),
                **dict(zip(names, self.softmax.tolist()))}
