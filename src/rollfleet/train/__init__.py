"""Training through the fleet: GRPO's loss over the coordinator's experiences (``grpo``).

``rollfleet train`` (the loop that submits batches, trains on what they return and pushes the
new weights to the engines) builds on this; see docs/train.md.
"""
