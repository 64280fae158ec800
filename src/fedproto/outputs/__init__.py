"""What a run leaves on disk: atomic writes (:mod:`fedproto.outputs.atomic`), the run folder
(:mod:`fedproto.outputs.run_folder`) and checkpoints (:mod:`fedproto.outputs.checkpoint`).
docs/architecture.md, "Layout".
"""
