"""LoRA adapters. `adapter_files` (torch-free, the front end's) reads and checks a PEFT
adapter directory; `weights` loads its tensors, `projection` applies them inside a batch
(folio/model/kernels/lora.py on CUDA)."""
