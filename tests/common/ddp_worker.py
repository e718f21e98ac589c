"""Run by test_ddp.py under torchrun: DDP training of a small MLP on CPU (gloo), saving what each rank ends with.

Each rank seeds differently before building its model, so equal final parameters can only come from DDP's
initial broadcast and gradient all-reduce.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from common.runtime import make_runtime, shutdown
from common.training import TensorBatches, Trainer, TrainSettings


def main(outdir: Path) -> None:
    runtime = make_runtime("cpu")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 2, generator=generator)
    y = 2 * x[:, :1] - x[:, 1:] + 0.5

    def validate(model: nn.Module) -> dict[str, float]:
        return {"val/mse": nn.functional.mse_loss(model(x), y).item()}

    torch.manual_seed(100 + runtime.rank)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    initial = {key: value.clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        loss_start = validate(model)["val/mse"]
    batches = TensorBatches(x, y, batch_size=16, seed=0, rank=runtime.rank, world_size=runtime.world_size)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), nn.functional.mse_loss,
                      runtime, TrainSettings(max_epochs=4, monitor="val/mse"))
    result = trainer.fit(batches, validate)
    with torch.no_grad():
        loss_end = validate(model)["val/mse"]
    torch.save(
        {
            "state": model.state_dict(),
            "initial": initial,
            "loss_start": loss_start,
            "loss_end": loss_end,
            "world_size": runtime.world_size,
            "backend": dist.get_backend(),
            "epochs_run": result.epochs_run,
        },
        outdir / f"rank{runtime.rank}.pt",
    )
    shutdown(runtime)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
