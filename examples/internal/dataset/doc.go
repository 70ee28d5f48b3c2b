// Package dataset is the labelled JPEG data set of the pipeline example
// (examples/datagen writes it, examples/loader and examples/python/train.py
// read it): WebDataset-style tar shards, shard-000000.tar, ..., each holding
// NNNNNN.jpg (a baseline 4:2:0 JPEG) and NNNNNN.cls (its class, decimal
// text) for consecutive keys, and index.json, which names the shards and
// gives every key's label, so that a consumer can check the labels it
// receives against the data set's.
//
// The images are synthetic but compress like photographs: smooth colour
// gradients under several octaves of value noise, a few shapes with soft
// edges, and per-pixel sensor noise. Every image is a function of the
// seed and its key alone, so a data set is reproducible anywhere.
package dataset
