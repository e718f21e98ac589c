"""The CLI and the use cases shipped with it, one package each (see common/usecase.py for what a package declares). Use
cases are discovered, not listed: every package in this folder with a presets/ folder, and every entry point of the
group `gpu_usecases.usecases`. Nothing here imports them; the CLI does, by name, when a command needs one."""
