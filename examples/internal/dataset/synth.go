package dataset

import (
	"image"
	"math"
	"math/rand/v2"
)

// Spec is how a data set's images are made.
type Spec struct {
	Seed    uint64
	Images  int
	Classes int
	// MinW..MaxW and MinH..MaxH bound the image sizes, drawn per image (real
	// data sets have no one size). Both minimums must be at least the crop
	// the loader takes.
	MinW, MaxW, MinH, MaxH int
	Quality                int
	PerShard               int
}

// DefaultSpec: 20,000 images of about 500x375 in 100 classes, quality 90,
// 1,000 per shard.
func DefaultSpec() Spec {
	return Spec{Seed: 1, Images: 20000, Classes: 100, MinW: 448, MaxW: 512, MinH: 336, MaxH: 400, Quality: 90, PerShard: 1000}
}

// rng is the generator for one image: a function of the seed and the key.
func rng(seed uint64, key int, stream uint64) *rand.Rand {
	return rand.New(rand.NewPCG(seed^0x9e3779b97f4a7c15*uint64(key+1), stream))
}

// Label is key's class.
func (s Spec) Label(key int) int {
	return int(rng(s.Seed, key, 1).Uint64N(uint64(s.Classes)))
}

// Size is key's image size.
func (s Spec) Size(key int) (w, h int) {
	r := rng(s.Seed, key, 2)
	return s.MinW + r.IntN(s.MaxW-s.MinW+1), s.MinH + r.IntN(s.MaxH-s.MinH+1)
}

// Image draws key's image.
func (s Spec) Image(key int) *image.RGBA {
	w, h := s.Size(key)
	r := rng(s.Seed, key, 3)
	label := s.Label(key)
	img := image.NewRGBA(image.Rect(0, 0, w, h))

	// A gradient between two colours, the first tied to the class (so that
	// the classes differ a little, as real ones do), at a random angle.
	hue := float64(label) / float64(max(1, s.Classes))
	c0 := hsv(hue, 0.5+0.3*r.Float64(), 0.5+0.4*r.Float64())
	c1 := hsv(math.Mod(hue+0.2+0.6*r.Float64(), 1), 0.3+0.5*r.Float64(), 0.3+0.6*r.Float64())
	ang := r.Float64() * 2 * math.Pi
	dx, dy := math.Cos(ang), math.Sin(ang)
	diag := math.Hypot(float64(w), float64(h))

	// Value noise: octaves of random lattices, interpolated smoothly, in
	// each channel (a shared luminance part and a weaker chroma part).
	type octave struct {
		cell float64
		amp  float64
		grid [3][]float64
		gw   int
	}
	var octs []octave
	cell, amp := 96.0, 0.35
	for o := 0; o < 5; o++ {
		gw, gh := int(float64(w)/cell)+2, int(float64(h)/cell)+2
		oc := octave{cell: cell, amp: amp, gw: gw}
		for c := 0; c < 3; c++ {
			oc.grid[c] = make([]float64, gw*gh)
			for i := range oc.grid[c] {
				oc.grid[c][i] = r.Float64()*2 - 1
			}
		}
		octs = append(octs, oc)
		cell /= 2.1
		amp *= 0.55
	}

	// Shapes: soft-edged discs and bars of random colours.
	type shape struct {
		cx, cy, rad, soft float64
		bar               bool
		col               [3]float64
	}
	shapes := make([]shape, 3+r.IntN(5))
	for i := range shapes {
		shapes[i] = shape{
			cx: r.Float64() * float64(w), cy: r.Float64() * float64(h),
			rad: 20 + r.Float64()*90, soft: 1 + r.Float64()*6, bar: r.IntN(3) == 0,
			col: hsv(r.Float64(), r.Float64(), 0.2+0.8*r.Float64()),
		}
	}

	pix := img.Pix
	var v [3]float64
	for y := 0; y < h; y++ {
		for x := 0; x < w; x++ {
			t := (float64(x)*dx + float64(y)*dy) / diag
			t = t*0.5 + 0.5
			for c := 0; c < 3; c++ {
				v[c] = c0[c]*(1-t) + c1[c]*t
			}
			for oi := range octs {
				oc := &octs[oi]
				fx, fy := float64(x)/oc.cell, float64(y)/oc.cell
				ix, iy := int(fx), int(fy)
				ux, uy := smooth(fx-float64(ix)), smooth(fy-float64(iy))
				i0 := iy*oc.gw + ix
				for c := 0; c < 3; c++ {
					g := oc.grid[c]
					a := g[i0] + (g[i0+1]-g[i0])*ux
					b := g[i0+oc.gw] + (g[i0+oc.gw+1]-g[i0+oc.gw])*ux
					n := a + (b-a)*uy
					if c == 0 {
						// luminance: to every channel
						v[0] += n * oc.amp * 0.6
						v[1] += n * oc.amp * 0.6
						v[2] += n * oc.amp * 0.6
					} else {
						v[c] += n * oc.amp * 0.25
						v[3-c] -= n * oc.amp * 0.1
					}
				}
			}
			for i := range shapes {
				sh := &shapes[i]
				var d float64
				if sh.bar {
					d = math.Abs(float64(y)-sh.cy) - sh.rad*0.25
				} else {
					ex, ey := math.Abs(float64(x)-sh.cx), math.Abs(float64(y)-sh.cy)
					if reach := sh.rad + sh.soft; ex > reach || ey > reach {
						continue
					}
					d = math.Sqrt(ex*ex+ey*ey) - sh.rad
				}
				if d < sh.soft {
					a := 1.0
					if d > -sh.soft {
						a = (sh.soft - d) / (2 * sh.soft)
					}
					a *= 0.8
					for c := 0; c < 3; c++ {
						v[c] = v[c]*(1-a) + sh.col[c]*a
					}
				}
			}
			// Sensor noise, mostly in luminance: triangular, from the bytes
			// of one random word (a normal draw per channel was a third of
			// the time).
			u := r.Uint64()
			ln := (float64(u&0xffff)+float64(u>>16&0xffff))/65535 - 1
			o := y*img.Stride + x*4
			for c := 0; c < 3; c++ {
				cn := float64(u>>(32+8*c)&0xff)/255 - 0.5
				pix[o+c] = clamp8((v[c] + ln*0.04 + cn*0.02) * 255)
			}
			pix[o+3] = 255
		}
	}
	return img
}

func smooth(t float64) float64 { return t * t * (3 - 2*t) }

func clamp8(f float64) uint8 {
	switch {
	case f <= 0:
		return 0
	case f >= 255:
		return 255
	}
	return uint8(f + 0.5)
}

// hsv is an RGB colour in [0,1] from hue, saturation and value in [0,1].
func hsv(h, s, v float64) [3]float64 {
	h = math.Mod(h, 1) * 6
	i := int(h)
	f := h - float64(i)
	p, q, t := v*(1-s), v*(1-s*f), v*(1-s*(1-f))
	switch i {
	case 0:
		return [3]float64{v, t, p}
	case 1:
		return [3]float64{q, v, p}
	case 2:
		return [3]float64{p, v, t}
	case 3:
		return [3]float64{p, q, v}
	case 4:
		return [3]float64{t, p, v}
	}
	return [3]float64{v, p, q}
}
