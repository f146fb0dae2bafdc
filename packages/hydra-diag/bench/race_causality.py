"""Are the race's entrants causal on the GPU, as the race runs them? A leak would fake a win.

    source tools/gpu_env.sh
    python packages/hydra-diag/bench/race_causality.py --configs gpt,gpt-ccgqa,hydra --out c.json

Each configuration is built as ``hydra-diag race run`` builds it (hydra_diag/race/loop.py), trained
for a few steps on random tokens so that causal-routing thresholds are committed and routers mix,
then run under bf16 autocast eagerly and through ``torch.compile`` in three ways: evaluation mode,
training mode without gradients, training mode with gradients (the race's training forward). For
each, the tokens after position t of a sequence are replaced and the largest change of the logits
at positions ≤ t is compared with the change after t. The CPU tests prove the rule in fp64
(tests/hydra_model/test_causal_routing.py); this checks the kernels and compiled code the GPU runs.
"""

from __future__ import annotations

import argparse
import json

import torch

from hydra_diag.health import logit_change


def check(model, fwd, x, x2, t: int, mode: str) -> dict:
    model.train(mode != "eval")
    grad = mode == "train+grad"
    with torch.set_grad_enabled(grad), torch.autocast(x.device.type, dtype=torch.bfloat16):
        before, after = logit_change(fwd(x).logits, fwd(x2).logits, t)
    return {"mode": mode, "max_dlogit_before_t": before, "max_dlogit_after_t": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="gpt,gpt-ccgqa,hydra")
    ap.add_argument("--model_size", default="100M")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--train_steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (use a tiny size)")
    args = ap.parse_args()

    from hydra_diag.race.configs import parse_config_names, resolve_configs
    from hydra_diag.race.loop import build_entrant

    dev = torch.device(args.device)
    names = parse_config_names(args.configs)
    rows = []
    for cfg in resolve_configs(names, [], lr=6e-4, compile_default="model"):
        torch.manual_seed(0)
        model = build_entrant(cfg, args.model_size, args.vocab, args.seq_len, dev).to(dev).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator(device=dev).manual_seed(1)
        for _ in range(args.train_steps):  # thresholds committed, routers past their start
            x = torch.randint(0, args.vocab, (2, args.seq_len + 1), device=dev, generator=g)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                model(x[:, :-1], targets=x[:, 1:]).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        x = torch.randint(0, args.vocab, (2, args.seq_len), device=dev, generator=g)
        t = args.seq_len // 2
        x2 = x.clone()
        x2[:, t + 1 :] = torch.randint(0, args.vocab, (2, args.seq_len - t - 1), device=dev, generator=g)
        if hasattr(model, "threshold_commit"):
            model.threshold_commit = "manual"  # both forwards of a pair route with the same thresholds
        compiled = torch.compile(model)
        for how, fwd in (("eager", model), ("compiled", compiled)):
            for mode in ("eval", "train", "train+grad"):
                r = check(model, fwd, x, x2, t, mode)
                r.update(config=cfg.name, how=how)
                r["causal"] = r["max_dlogit_before_t"] <= 1e-3 * max(1.0, r["max_dlogit_after_t"])
                rows.append(r)
                print(
                    f"{cfg.name:<18} {how:<9} {mode:<11} before t {r['max_dlogit_before_t']:.2e}  "
                    f"after t {r['max_dlogit_after_t']:.2e}  {'causal' if r['causal'] else 'LEAK'}"
                )
        del model, compiled, opt
        torch._dynamo.reset()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    bad = [r for r in rows if not r["causal"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} causal")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
