package dataset

import (
	"bytes"
	"fmt"
	"image"
	"image/color"
	"image/jpeg"
	"math/rand/v2"
)

// CropOffset is where the loader crops an image of w x h to a crop x crop
// square: drawn from seed, the epoch and the key, so a check can redo it,
// and uniform over every position that fits.
func CropOffset(seed uint64, epoch, key, w, h, crop int) (x, y int) {
	r := rand.New(rand.NewPCG(seed^uint64(epoch)*0xbf58476d1ce4e5b9, uint64(key)))
	return r.IntN(w - crop + 1), r.IntN(h - crop + 1)
}

// Config reads a JPEG's size from its header.
func Config(jpg []byte) (w, h int, err error) {
	c, err := jpeg.DecodeConfig(bytes.NewReader(jpg))
	if err != nil {
		return 0, 0, err
	}
	return c.Width, c.Height, nil
}

// DecodeCrop decodes jpg with image/jpeg and writes the crop x crop square
// at (x, y) into dst as planar RGB: 3 planes of crop x crop bytes, R, G,
// B (NCHW for one image, what nvJPEG's NVJPEG_OUTPUT_RGB gives). Chroma is
// taken at the nearest sample, as image.YCbCr does; nvJPEG and libjpeg
// interpolate it, so their pixels differ by a few levels.
func DecodeCrop(jpg []byte, x, y, crop int, dst []byte) error {
	if len(dst) < 3*crop*crop {
		return fmt.Errorf("%w: DecodeCrop into %d bytes, need %d", ErrDataset, len(dst), 3*crop*crop)
	}
	img, err := jpeg.Decode(bytes.NewReader(jpg))
	if err != nil {
		return err
	}
	b := img.Bounds()
	if x < 0 || y < 0 || x+crop > b.Dx() || y+crop > b.Dy() {
		return fmt.Errorf("%w: crop %d at (%d,%d) of a %dx%d image", ErrDataset, crop, x, y, b.Dx(), b.Dy())
	}
	plane := crop * crop
	r, g, bl := dst[:plane], dst[plane:2*plane], dst[2*plane:3*plane]
	switch m := img.(type) {
	case *image.YCbCr:
		for j := 0; j < crop; j++ {
			py := b.Min.Y + y + j
			for i := 0; i < crop; i++ {
				px := b.Min.X + x + i
				yi, ci := m.YOffset(px, py), m.COffset(px, py)
				rr, gg, bb := color.YCbCrToRGB(m.Y[yi], m.Cb[ci], m.Cr[ci])
				o := j*crop + i
				r[o], g[o], bl[o] = rr, gg, bb
			}
		}
	case *image.Gray:
		for j := 0; j < crop; j++ {
			for i := 0; i < crop; i++ {
				v := m.GrayAt(b.Min.X+x+i, b.Min.Y+y+j).Y
				o := j*crop + i
				r[o], g[o], bl[o] = v, v, v
			}
		}
	default:
		for j := 0; j < crop; j++ {
			for i := 0; i < crop; i++ {
				c := color.RGBAModel.Convert(img.At(b.Min.X+x+i, b.Min.Y+y+j)).(color.RGBA)
				o := j*crop + i
				r[o], g[o], bl[o] = c.R, c.G, c.B
			}
		}
	}
	return nil
}
