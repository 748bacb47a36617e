"""`sluice generate`, `sluice chat` and `sluice demo`: text from a model, on the terminal."""

from __future__ import annotations

import dataclasses
import json
import sys

from ..errors import RequestError, SluiceError
from .common import constraint_of, engine_config, load_llm, sampling_params, stdin_lines, tp_rank, utf8_arg


def cmd_generate(args) -> int:
    params = dataclasses.replace(sampling_params(args), constraint=constraint_of(args))  # validate before the (slow) load
    utf8_arg(args.prompt, "the prompt")
    config = engine_config(args)  # every engine flag checked, before the (slow) load
    tp_rank(args, "generate")
    if (args.tp or 1) > 1:  # every rank runs this same command, in lockstep; rank 0 prints
        from ..parallel import shutdown
        try:
            return _generate(args, params, config)
        finally:
            shutdown()
    return _generate(args, params, config)


def _generate(args, params, config) -> int:
    llm = load_llm(args, config)
    prompt = args.prompt
    if args.chat:
        prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}])
    if args.json:
        out = llm.generate([prompt], params)[0]
        print(json.dumps({"prompt": args.prompt, "text": out.text, "token_ids": out.token_ids,
                          "finish_reason": out.finish_reason, "stats": llm.last_stats.as_dict()},
                         ensure_ascii=False))
        return 0
    deltas = llm.stream(prompt, params)  # a request that cannot run fails here, before the echo
    if not args.chat:
        sys.stdout.write(args.prompt)
    for delta in deltas:
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = llm.last_stats
    print(f"[{s.prompt_tokens} prompt tokens, {s.generated_tokens} generated "
          f"({llm.last_output.finish_reason}); prefill {s.prefill_tok_s:.1f} tok/s, "
          f"decode {s.decode_tok_s:.1f} tok/s]", file=sys.stderr)
    if s.speculative != "off":
        k = llm.num_speculative_tokens
        print(f"[speculative ({s.speculative}, {'adaptive' if k == 'auto' else k} tokens per guess): {s.proposed} "
              f"proposed, {s.accepted} accepted ({100 * s.acceptance_rate:.1f}%), "
              f"{s.tokens_per_forward:.2f} tokens per forward of the model]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    params = sampling_params(args)
    utf8_arg(args.system or "", "--system")
    llm = load_llm(args, engine_config(args))
    system = [{"role": "system", "content": args.system}] if args.system else []
    stdin_lines()
    history = list(system)
    print("sluice chat: /reset clears the conversation, /exit or Ctrl-D quits, "
          "Ctrl-C stops a reply.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        line = line.strip()
        if not line:
            continue
        try:
            utf8_arg(line, "that line")
        except RequestError as e:
            print(f"error: {e}; nothing was sent", file=sys.stderr)
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            history = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt = llm.chat_prompt(history)
        except SluiceError as e:
            history.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        reply = []
        try:
            for delta in llm.stream(prompt, params):
                reply.append(delta)
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        except SluiceError as e:  # e.g. the conversation outgrew the context: say so, keep going
            history.pop()
            print(f"\nerror: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_demo(args) -> int:
    from ..demo import run_demo
    return run_demo(load_llm(args))
