"""Pipeline parallelism: split a captured graph into stages and train them on torch.distributed."""
