"""A smoke run made smaller for the tests of what runs around the models (copies, signals, the advisor): one finance
baseline and 3 epochs; medical's images fewer, without the bootstrap and Grad-CAM. Not in an export's tests, which
name no other use case."""

PLUMBING = {name: [argument for setting in settings for argument in ("--set", setting)] for name, settings in {
    "finance": ["baselines.models=[ewma]", "train.epochs=3"],
    "medical": ["data.synthetic.train=96", "data.synthetic.val=64", "data.synthetic.test=64", "evaluation.bootstrap=0",
                "evaluation.gradcam_examples=0"],
    "recsys": []}.items()}
