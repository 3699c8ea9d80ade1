"""What every lesson stands on: the device (`device`), the exact byte tracker (`track`), the virtual GPU
(`virtual_gpu`), the estimators (`estimate`), the course's models (`models`), the one GPU table (`gpus`), the one
dtype-size function (`dtypes`) and the input checks every public function uses (`validate`)."""
