"""Files of a filesystem on a mounted namespace (FIEMAP), and safetensors checkpoints."""
