"""Weight I/O above the model: where each checkpoint tensor's rows land on a rank (plan.py), the
sources they are read from (source.py, safetensors_header.py), the loader that fills a model built
on the meta device (loader.py), and the writer of merged checkpoints (writer.py)."""
