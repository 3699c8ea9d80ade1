"""Lesson 00 and the GPU figures: the memory hierarchy and the roofline (`hierarchy`), timing done right
(`timing`), and numbers recorded on a real GPU for machines without one (`recorded`)."""
