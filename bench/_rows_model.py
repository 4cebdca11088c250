"""README rows for the engine, weights and training benchmarks."""

from __future__ import annotations

from typing import Any

from bench._report_cells import n, spread


def engine_rows(d: dict[str, Any]) -> list[str]:
    b = d["llamacpp"]["batched"]
    return [
        f"| engines | llama.cpp SmolLM2-135M tokens/s at concurrency 1 / 4 / 8 | "
        f"{n(b['1'])} / {n(b['4'])} / {n(b['8'])} | – | {d['llamacpp']['batched_ratio_vs_1']['8']:.2f}× at 8 |",
        f"| engines | gateway overhead per request over HTTP (trivial engine) | "
        f"{d['overhead']['echo']['overhead_http_ms']:.2f} ms | – | target ≤ 2 ms |",
    ]


def hf_batching_rows(d: dict[str, Any]) -> list[str]:
    """Continuous batching on the HF engine vs static batching with model.generate."""
    w, ours, theirs = d["workload"], d["rollfleet"], d["baseline"]
    what = (
        f"{w['requests']} greedy requests arriving every {w['gap_s'] * 1000:.0f} ms, "
        f"{min(w['lengths'])}–{max(w['lengths'])} tokens, at most {w['max_batch']} rows "
        f"({w['model']}), median [range] of {d['rounds']} alternating rounds; same tokens: "
        f"{d['same_tokens']}"
    )
    return [
        f"| hf engine | first arrival to last completion, {what} | "
        f"{spread(ours['makespan_s'], 1, unit=' s')} (continuous batching) | "
        f"{spread(theirs['makespan_s'], 1, unit=' s')} (model.generate on what has arrived) | "
        f"{d['makespan_speedup']:.2f}× |",
        f"| hf engine | mean latency, arrival to completion, same run | "
        f"{spread(ours['mean_latency_s'], 2, unit=' s')} | "
        f"{spread(theirs['mean_latency_s'], 2, unit=' s')} | {d['latency_speedup']:.2f}× |",
    ]


def weights_rows(d: dict[str, Any]) -> list[str]:
    sync, swaps = d["sync"], d["swaps"]
    rows = [
        f"| weights | push of a SmolLM2-135M-shaped state dict ({sync['megabytes']:.0f} MB fp32) to a gateway "
        f"in another process on this host (shared memory), median of 3 alternating rounds{_push_parts(sync)} | {sync['push_mb_s']:,.0f} MB/s | {sync['memcpy_mb_s']:,.0f} MB/s (in-memory copy "
        f"of the same tensors: the limit) | {sync['push_vs_memcpy']:.2f}× |",
        f"| weights | generation stopped while the HF engine installs a pushed update (double buffer: a "
        f"pointer swap; the KV recompute of running rows is in the swap delay below) | "
        f"{sync['install_s']['median'] * 1000:.3f} ms | "
        f"{sync['in_process']['in_place']['pause_s']['median'] * 1000:.0f} ms (in-place copy) | target ≤ 50 ms |",
    ]
    for mode in ("interruptible", "drain", "abort"):
        f = swaps[mode]
        rows.append(
            f"| weights | tokens/s kept, {d['concurrent']} generations of {d['max_tokens']} tokens, a swap every "
            f"{d['swap_every_s']:.0f} s (HF, CPU): {mode} | {f['tokens_per_s']['median']:.1f} (swap delay "
            f"{f['swap_delay_s']:.2f} s, {f['wasted_tokens']:.0f} tokens thrown away) | "
            f"{swaps['none']['tokens_per_s']['median']:.1f} (no swaps) | {f['kept_vs_no_swaps']:.2f}× |"
        )
    return rows


def _push_parts(sync: dict[str, Any]) -> str:
    """Where a push's time goes (runs from before the split was measured have none)."""
    if "write_s" not in sync:
        return ""
    parts = (sync[k]["median"] * 1000 for k in ("push_s", "write_s", "receive_s", "update_s"))
    return (
        ": {:.0f} ms, of it the trainer writing its memfds {:.0f} ms, the gateway mapping and"
        " checking them {:.0f} ms, the engine's update {:.0f} ms".format(*parts)
    )


def llamacpp_weights_rows(d: dict[str, Any]) -> list[str]:
    rows = []
    for kind in ("f16", "q8_0"):
        loaded = d[kind]["loaded"]
        rows.append(
            f"| weights | llama.cpp: longest stop between tokens while a {kind} update of SmolLM2-135M is "
            f"exported and swapped in under 4 streaming clients (interruptible) | "
            f"{loaded['longest_gap_during_update_s']:.2f} s | {loaded['longest_gap_before_s']:.2f} s "
            f"(longest gap before) | target ≤ 1 s |"
        )
    return rows


def llama_server_rows(d: dict[str, Any]) -> list[str]:
    m = d["models"]["q8_0"]
    e, s = m["engine"]["tokens_per_s"], m["llama_server"]["tokens_per_s"]
    rows = [
        f"| engines | llama.cpp engine vs llama-server (`-np 8`, same Q8_0 file, 2 threads) tokens/s at {c}, "
        f"median of 3 alternating rounds | {e[c]['median']:.1f} | {s[c]['median']:.1f} | "
        f"{e[c]['median'] / s[c]['median']:.2f}× |"
        for c in ("1", "4", "8")
    ]
    rows.append(
        f"| engines | tokens/s at 8 vs at 1 (goal 2.5×; plain llama.cpp decode of 8 sequences here: "
        f"{m['bare_decode']['ratio_8_vs_1']:.2f}×, the machine's limit) | {m['engine']['ratio_8_vs_1']:.2f}× | "
        f"{m['llama_server']['ratio_8_vs_1']:.2f}× (llama-server) | – |"
    )
    return rows


def train_step_rows(d: dict[str, Any]) -> list[str]:
    sides, st = d["sides"], d["settings"]
    full = sides["full"]["step_s"]["median"]
    rows = []
    for name, label in (
        ("lora_qv", "LoRA r=16 on q and v"),
        ("lora_all", "LoRA r=16 on every linear layer"),
    ):
        f = sides[name]["step_s"]
        rows.append(
            f"| train | one GRPO step, {st['rows']} x {st['prompt_tokens'] + st['action_tokens']} tokens, "
            f"SmolLM2-135M on 2 cores: {label} | {f['median']:.2f} s ({f['min']:.2f}-{f['max']:.2f}) | "
            f"{full:.2f} s (full fine-tuning) | {full / f['median']:.2f}× faster |"
        )
    if "shared_prompt" in d:
        g = d["shared_prompt"]
        s, w, gs = g["shared"], g["whole"], g["settings"]
        rows.append(
            f"| train | one GRPO step on {gs['groups']} prompts ({gs['prompt_tokens']} tokens) x "
            f"{gs['group']} rows, LoRA q/v, 1 thread: each group's prompt computed once, "
            f"{gs['rounds']} alternating rounds | {s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f}) | "
            f"{w['median']:.2f} s ({w['min']:.2f}-{w['max']:.2f}; every row whole, before) | "
            f"{g['speedup']:.2f}× faster |"
        )
    return rows


def weights_delta_rows(d: dict[str, Any]) -> list[str]:
    lora, full = d["cases"]["lora_style"], d["cases"]["full"]
    b, http, file = lora["bytes"], lora["push_s"]["http"], lora["push_s"]["file"]
    return [
        f"| weights | delta push after one AdamW step of SmolLM2-135M (fp32), q_proj and v_proj trainable "
        f"(LoRA-style): bytes sent ({lora['tensors']['delta']} of {lora['tensors']['full']} tensors changed) | "
        f"{b['delta'] / 1e6:,.0f} MB | {b['full'] / 1e6:,.0f} MB (full push) | {b['delta'] / b['full']:.2f}× |",
        f"| weights | the same, push to a gateway in this process over HTTP / same host (file), median of "
        f"{d['rounds']} alternating rounds | {http['delta']['median']:.2f} s / {file['delta']['median']:.2f} s | "
        f"{http['full']['median']:.2f} s / {file['full']['median']:.2f} s (full push) | "
        f"{http['delta_vs_full']:.1f}× / {file['delta_vs_full']:.1f}× faster |",
        f"| weights | delta push after one AdamW step, full fine-tuning: every tensor changed "
        f"({full['elements_changed']:,} of {full['elements']:,} weights) | {full['bytes']['delta'] / 1e6:,.0f} MB | "
        f"{full['bytes']['full'] / 1e6:,.0f} MB "
        f"(full push) | {full['bytes']['delta'] / full['bytes']['full']:.2f}× (no saving) |",
    ]


def train_sched_rows(d: dict[str, Any]) -> list[str]:
    c, s, sync = d["config"], d["summary"], d["summary"]["0"]
    ceiling, rounds = d["ceiling_speedup"]["median"], c["rounds"]

    def cell(f: dict[str, Any]) -> str:
        return spread(f)

    rows = []
    for k in (str(k) for k in c["ks"] if k):
        f = s[k]
        rows.append(
            f"| scheduler | samples consumed/s, simulated RL loop through the coordinator ({c['tasks']} "
            f"log-normal tasks a batch, train {c['train_s']} s + push {c['push_s']} s), max_staleness "
            f"K={k} vs synchronous, median [range] of {rounds} alternating rounds | {cell(f['samples_per_s'])}"
            f", staleness max {f['staleness_measured_max']} | {cell(sync['samples_per_s'])} (K=0) | "
            f"{f['speedup_vs_sync']['median']:.2f}× (ceiling {ceiling:.2f}×; AReaL reports up to "
            f"{d['areal']['speedup']}× on GPUs) |"
        )
    checks = d["checks"]
    rows.append(
        f"| scheduler | consumed samples staler than K / finished samples never consumed / consumed "
        f"twice, all runs | {checks['over_k']} / {checks['never_consumed']} / {checks['consumed_twice']} "
        f"| – | goal 0 |"
    )
    return rows


def train_threads_rows(d: dict[str, Any]) -> list[str]:
    st, split, shared = d["settings"], d["sides"]["split"], d["sides"]["shared"]

    def cell(f: dict[str, Any]) -> str:
        keys = ("seconds/wait", "seconds/train", "seconds/sync")
        parts = " / ".join(f"{f['split_s'][key]:.1f}" for key in keys)
        return f"{spread(f['samples_per_s'], 2)} samples/s, step {f['step_s']['median']:.1f} s ({parts})"

    engine, trainer = st["split"]["engine_threads"], st["split"]["trainer_threads"]
    return [
        f"| train | cores by phase at max_staleness K={st['max_staleness']}: `rollfleet train` on the real SmolLM2 "
        f"(LoRA, {st['tasks']} x {st['group']} samples a step, {st['max_tokens']} tokens, {st['steps']} steps, "
        f"{st['cores']} cores), every core to both engine and trainer (the default) vs the cores split, median "
        f"[range] of {st['rounds']} alternating rounds; step s wait / train / sync | {cell(shared)} | "
        f"{cell(split)} (split: engine {engine} / trainer {trainer} threads) | {1 / d['split_vs_shared']:.2f}× |"
    ]


def train_rows(d: dict[str, Any]) -> list[str]:
    st, sides = d["settings"], d["sides"]
    sync = sides["0"]

    def cell(f: dict[str, Any]) -> str:
        return spread(f, 2)

    rows = []
    for k in (k for k in sides if k != "0"):
        f = sides[k]
        split = " / ".join(
            f"{f['split_s'][key]:.1f}" for key in ("seconds/wait", "seconds/train", "seconds/sync")
        )
        rows.append(
            f"| train | samples trained/s, `rollfleet train` on the real SmolLM2 (LoRA, {st['tasks']} x "
            f"{st['group']} samples a step, {st['max_tokens']} tokens, {st['steps']} steps, 2 cores shared by "
            f"engine and trainer), max_staleness K={k} vs synchronous, median [range] of {st['rounds']} "
            f"alternating rounds; step s wait / train / sync {split} | {cell(f['samples_per_s'])} | "
            f"{cell(sync['samples_per_s'])} (K=0) | {f['vs_sync']:.2f}× |"
        )
    return rows


def multimodal_rows(d: dict[str, Any]) -> list[str]:
    """Image delta on the HF tiny VLM: per-turn latency with and without the cache (bench/multimodal.py)."""
    lat = d.get("latency")
    if not lat:
        return []
    last, total = lat["per_turn_s"][-1], lat["conversation_s"]

    def cell(s: dict[str, float]) -> str:
        return spread(s, 0, scale=1000, unit=" ms")

    calls = lat["encoder_calls"]
    return [
        f"| multimodal | turn {last['turn']} latency of a {lat['turns']}-turn screenshot conversation resent "
        f"whole each turn (tiny random VLM, HF, CPU), image delta vs no cache, median [range] of "
        f"{lat['rounds']} alternating rounds; encoder calls {calls['cached']} vs {calls['uncached']}, same "
        f"tokens: {lat['same_tokens']} | {cell(last['cached'])} | {cell(last['uncached'])} (no cache) | "
        f"{lat['last_turn_speedup']:.2f}× |",
        f"| multimodal | the whole {lat['turns']}-turn conversation, image delta vs no cache | "
        f"{cell(total['cached'])} | {cell(total['uncached'])} (no cache) | {lat['conversation_speedup']:.2f}× |",
        *storage_rows(d.get("storage")),
    ]


def storage_rows(st: dict[str, Any] | None) -> list[str]:
    """Bytes stored per screenshot trajectory: images by content vs inline base64."""
    if not st:
        return []
    return [
        f"| multimodal | bytes stored per trajectory, {st['turns']}-turn conversation with one new 1280x720 PNG "
        f"screenshot a turn, each step carrying the whole conversation (real SQLite store) | "
        f"{st['content_addressed_bytes_per_trajectory'] / 1e3:,.0f} kB (images once, by content) | "
        f"{st['inline_base64_bytes_per_trajectory'] / 1e3:,.0f} kB (inline base64, as before) | "
        f"{st['ratio']:.1f}× less |"
    ]


def train_agent_rows(d: dict[str, Any]) -> list[str]:
    """Token-in across turns vs re-tokenizing every turn, 3-turn lookup conversations."""
    st, a, b = d["settings"], d["sides"]["token_in"], d["sides"]["retokenize"]
    what = (
        f"{st['turns']}-turn lookup conversations (bundled SmolLM2, llama.cpp, {st['conversations']} "
        f"concurrent, {st['max_tokens']} tokens, T={st['temperature']:g}), median [range] of "
        f"{st['rounds']} alternating rounds"
    )
    one = a["one_row_share"]["median"], b["one_row_share"]["median"]
    return [
        f"| agent training | prompt tokens prefilled per rollout (prompt minus prefix-cache hits), "
        f"{what} | {spread(a['prefilled_tokens_per_rollout'])} (token-in) | "
        f"{spread(b['prefilled_tokens_per_rollout'])} (re-tokenize every turn) | "
        f"{d['prefilled_ratio']:.2f}× (re-tokenize / token-in) |",
        f"| agent training | training rows per rollout, same runs; conversations that train as one "
        f"row {one[0]:.0%} vs {one[1]:.0%}; action tokens differing from the sampled ones "
        f"{a['action_mismatches']} | {spread(a['rows_per_rollout'], 2)} (token-in) | "
        f"{spread(b['rows_per_rollout'], 2)} (re-tokenize every turn) | "
        f"{d['rows_ratio']:.2f}× (re-tokenize / token-in) |",
        f"| agent training | tokens the trainer processes per rollout (its rows' lengths: a split "
        f"row repeats the conversation so far), same runs | "
        f"{spread(a['trained_tokens_per_rollout'])} (token-in) | "
        f"{spread(b['trained_tokens_per_rollout'])} (re-tokenize every turn) | "
        f"{d['trained_ratio']:.2f}× (re-tokenize / token-in) |",
    ] + _agent_step_rows(d.get("step"))


def _agent_step_rows(step: dict[str, Any] | None) -> list[str]:
    """The step time of the real multi-turn run and its split, when the bench read its metrics."""
    if not step:
        return []
    split = " / ".join(f"{step[f'seconds/{k}']['median']:.1f}" for k in ("wait", "train", "sync"))
    return [
        f"| agent training | one step of the real multi-turn run (`rollfleet train --mode lookup`, "
        f"{step.get('rollouts_per_step')} rollouts of up to 3 turns a step, LoRA, K=1, engine "
        f"and trainer on 2 cores; "
        f"[docs/train.md](train.md)), median [range] of its {step['steps']} steps; "
        f"wait / train / sync {split} s | {spread(step['seconds/step'])} s | – | – |"
    ]


def capability_rows(d: dict[str, Any]) -> list[str]:
    """An attempt capability against the operator token it replaced, per gateway call."""
    check, call = d["check_us"], d["call_ms"]

    def cell(figure: dict[str, float], digits: int) -> str:
        return (
            f"{figure['median']:.{digits}f} [{figure['min']:.{digits}f}–{figure['max']:.{digits}f}]"
        )

    return [
        f"| gateway | µs per caller check, p50 [range of {d['rounds']} alternating rounds]: an attempt "
        f"capability (HMAC) vs the operator token | {cell(check['capability'], 2)} | "
        f"{cell(check['token'], 2)} (token) | +{check['added']:.2f} µs (target ≤ 100) |",
        f"| gateway | ms per `GET /v1/models` over HTTP, same rounds | {cell(call['capability'], 3)} | "
        f"{cell(call['token'], 3)} (token) | {call['capability']['median'] / call['token']['median']:.2f}× |",
    ]


def tool_calls_rows(d: dict[str, Any]) -> list[str]:
    """What reading tool calls adds to a gateway call, with 4 tools offered against none."""
    paths, rounds = d["paths"], d["rounds"]

    def row(what: str, pair: dict[str, Any]) -> str:
        return (
            f"| gateway | µs per call, {what}, p50 [range of {rounds} alternating rounds] | "
            f"{spread(pair['with'])} ({d['tools']} tools) | {spread(pair['without'])} (no tools) | "
            f"+{pair['added']:.1f} µs (target ≤ 200) |"
        )

    stream = max(paths["stream"].items(), key=lambda item: item[1]["added"])
    return [
        row("request body parsed and checked", paths["request"]["messages"]),
        row("answer read for one tool call, shaped and recorded", paths["answer"]["one call"]),
        row(f"streamed answer ({stream[0]}: the most added of 4 texts)", stream[1]),
    ]


def train_vs_trl_rows(d: dict[str, Any]) -> list[str]:
    """``rollfleet train`` at K=0 and K=1 against TRL's GRPOTrainer, side by side."""
    st, sides = d["settings"], d["sides"]
    trl = sides["trl"]
    what = (
        f"GRPO on the bundled SmolLM2-135M, {st['steps']} steps x {st['tasks_per_step']} tasks x "
        f"{st['group']} samples, {st['max_tokens']} tokens, LoRA r={st['lora']['r']} on q/v, the "
        f"same tasks, prompts, reward and optimizer; TRL generates with transformers, rollfleet "
        f"with llama.cpp; median [range] of {st['rounds']} alternating rounds"
    )
    rows = []
    for key, name in (("k0", "K=0"), ("k1", "K=1")):
        s = sides[key]
        split = " / ".join(f"{s['split_s'][k]:.1f}" for k in ("generate_s", "train_s", "sync_s"))
        trl_split = " / ".join(
            f"{trl['split_s'][k]:.1f}" for k in ("generate_s", "train_s", "sync_s")
        )
        rows += [
            f"| train vs TRL | samples/s, {what}; rollfleet train {name} | "
            f"{spread(s['samples_per_s'], 2)} | {spread(trl['samples_per_s'], 2)} (TRL "
            f"GRPOTrainer); steps that trained nothing (every group scored alike, so no "
            f"backward pass): {s['untrained_steps']} of {len(s['samples']) * st['steps']} | "
            f"{s['vs_trl']:.2f}× (goal 2×) |",
            f"| train vs TRL | seconds a step (generate / train / sync), the same runs; {name} | "
            f"{spread(s['step_s'])} ({split}) | {spread(trl['step_s'])} ({trl_split}) | "
            f"{trl['step_s']['median'] / s['step_s']['median']:.2f}× faster |",
            f"| train vs TRL | held-out greedy reward ({st['eval']['tasks']} tasks; untrained "
            f"{d['untrained_heldout']['reward']:.2f}) after {st['steps']} steps / at the wall time "
            f"of the round's fastest side, the same runs; {name} | "
            f"{spread(s['heldout'], 2)} / {spread(s['heldout_at_budget'], 2)} | "
            f"{spread(trl['heldout'], 2)} / {spread(trl['heldout_at_budget'], 2)} | |",
        ]
    return rows
