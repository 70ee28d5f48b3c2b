package driver

import (
	"github.com/seed743c36cf/cudashare/driver/internal/api"
	"github.com/seed743c36cf/cudashare/driver/internal/cuda"
	"github.com/seed743c36cf/cudashare/driver/internal/sim"
)

func openCUDA(path string) (api.API, error) {
	d, err := cuda.Load(path)
	if err != nil {
		return nil, err
	}
	return d, nil
}

func openSim() (api.API, error) {
	d, err := sim.New()
	if err != nil {
		return nil, err
	}
	return d, nil
}
