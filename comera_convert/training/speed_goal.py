"""A speed target's arithmetic: the budget's cost (microseconds a batch the gates' open entries cost) against
the speed it buys, from the times measured as training starts.

The model runs ``model_microseconds`` a batch as training starts, of which its gates' open entries cost
``start_cost`` (their prices summed, ``hf/gate_prices.py``); the rest (attention's products, norms, the
embedding, what the prices miss) does not shrink as gates close. At a cost ``c`` the model is estimated to
run ``model_microseconds - (start_cost - c)``, and its speed is the dense model's time over that. The
estimate steers the budget; the speed reached is measured on the exported graph when training ends.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeedGoal:
    runtime: str
    target_speedup: float
    dense_microseconds: float  # a batch, the dense model in its fastest form in the runtime
    model_microseconds: float  # a batch, the compressed model as training starts, in its fastest form
    start_cost: int = 0  # the gates' cost when the prices were taken

    def microseconds(self, cost: float) -> float:
        """The model's estimated time a batch with its gates at ``cost``."""
        return self.model_microseconds - (self.start_cost - cost)

    def estimate(self, cost: float) -> float:
        """The speed against the dense model the model is estimated to run at with its gates at ``cost``."""
        return self.dense_microseconds / max(self.microseconds(cost), 1e-9)

    def excess_microseconds(self, cost: float) -> float:
        """How much the gates at ``cost`` must still shed for the model to run at ``target_speedup``."""
        return self.microseconds(cost) - self.dense_microseconds / self.target_speedup

    def to_dict(self) -> dict:
        return dict(self.__dict__)
