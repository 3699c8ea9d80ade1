"""What every lesson stands on: the device (`device`), the exact byte tracker (`track`), the virtual GPU
(`virtual_gpu`), the estimators (`estimate`), the course's models (`models`) and the GPU data sheets
(`gpus`)."""
