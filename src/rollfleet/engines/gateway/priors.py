"""What the gateway keeps of each rollout's calls so that its next call continues token-in
(:mod:`~rollfleet.engines.continuation`), in whichever attempt makes it."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from rollfleet.engines.base import Generation, GenerationRequest
from rollfleet.engines.continuation import PriorCall, continues

MAX_PRIOR_ROLLOUTS, PRIOR_CALLS = 4096, 4  # the calls kept for token-in continuation


class Priors:
    """The last calls of each rollout, so that its next call continues token-in
    (:mod:`~rollfleet.engines.continuation`), in whichever attempt: a later attempt that resumes
    the conversation continues from the calls an earlier one made. Bounded in rollouts and calls
    per rollout; only a rollout's own calls are ever continued (a capability names its rollout)."""

    def __init__(self, rollouts: int = MAX_PRIOR_ROLLOUTS, calls: int = PRIOR_CALLS) -> None:
        self.by_rollout: OrderedDict[str, list[PriorCall]] = OrderedDict()
        self.rollouts, self.calls = rollouts, calls

    def attach(
        self, request: GenerationRequest, rollout_id: str | None, model: str
    ) -> GenerationRequest:
        """``request`` with the latest earlier call of its rollout that it continues (or asks
        again), when the same model answered it."""
        if request.messages is None or not rollout_id or rollout_id not in self.by_rollout:
            return request
        messages = request.messages
        for prior in reversed(self.by_rollout[rollout_id]):
            if prior.model == model and (
                prior.messages == messages or continues(prior, messages, request.tools)
            ):
                return dataclasses.replace(request, prior=prior)
        return request

    def remember(
        self, request: GenerationRequest, result: Generation, rollout_id: str | None
    ) -> None:
        """Keep a finished chat call as one its rollout's next calls may continue."""
        if request.messages is None or not rollout_id or result.aborted:
            return
        call = PriorCall(
            request.request_id,
            result.model,
            list(request.messages),
            list(result.prompt_token_ids),
            list(result.completion_token_ids),
            result.finish_reason.value,
            result.text,
            request.tools,
        )
        kept = self.by_rollout.setdefault(rollout_id, [])
        kept.append(call)
        del kept[: -self.calls]
        self.by_rollout.move_to_end(rollout_id)
        while len(self.by_rollout) > self.rollouts:
            self.by_rollout.popitem(last=False)
