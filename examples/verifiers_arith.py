"""A verifiers (0.4) taskset, trained and run by rollfleet as it is: sums of small numbers,
scored by the taskset's own rewards.

rollfleet tasks verifiers examples/verifiers_arith.py:make -o arith.jsonl
rollfleet run --mode verifiers:examples/verifiers_arith.py:make --data arith.jsonl
"""

import re

import verifiers.v1 as vf


class Sum(vf.TaskData):
    answer: int


class SumTask(vf.Task[Sum]):
    @vf.reward
    async def correct(self, task: Sum, trace: vf.Trace) -> float:
        """1.0 when the last number of the reply is the sum."""
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == task.answer)

    @vf.reward(weight=0.1)
    async def brief(self, trace: vf.Trace) -> float:
        """A little credit for answering in one short line."""
        return float(len(trace.last_reply) <= 40)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for a in range(2, 10):
            for b in range(3, 7):
                yield SumTask(Sum(prompt=f"What is {a} + {b}?", answer=a + b), self.config.task)


def make() -> SumTaskset:
    return SumTaskset(vf.TasksetConfig(id="sums"))
