"""Local stand-ins for two WebArena websites, served from this process on 127.0.0.1.

- the shop ("One Stop Market", in the place of WebArena's Magento storefront `SHOPPING`): search
  with pagination and sorting, category pages, product pages with reviews, a cart, checkout,
  orders, a wish list and a customer login at Magento's URLs (`/catalogsearch/result/?q=`,
  `/checkout/cart/`, `/customer/account/login/`, `/sales/order/history/`, ...);
- the forum ("Postmill", in the place of WebArena's Postmill `REDDIT`): forums, paginated
  submission lists, posts with votes and comments, search, user pages, submitting, and a login,
  at Postmill's URLs (`/f/<forum>/<id>/<slug>`, `/submit/<forum>`, `/login`, ...);
- a homepage linking both (WebArena's `HOMEPAGE`), plus pages the tests need (`/test/slow`
  never answers in time, `/test/freeze` hangs its renderer on a click, `/test/external` links and
  embeds things outside the allowed sites, `/test/long` shows a tree text of over 8,192
  characters in one viewport).

The accounts are WebArena's (`ACCOUNTS` in tasks.py), so the same auto-login code signs in here and
on the real sites. Every browser context gets its own `sid` cookie and all state a task can change
(cart, orders, reviews, wish list, posts, comments, votes) lives under that session on top of the
shared seed data: envs running in parallel never see each other's changes, and a fresh context
starts from the seed. The login is a separate `auth` cookie, which can be shared across contexts.

Stdlib only: one WSGI app per site, each on its own ThreadingWSGIServer in a daemon thread.
"""

from __future__ import annotations

import html
import re
import secrets
import threading
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from socketserver import ThreadingMixIn
from urllib.parse import parse_qs, urlencode
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

SHOP_USER = ("emma.lopez@gmail.com", "Password.123", "Emma Lopez")
FORUM_USER = ("MarvelsGrantMan136", "test1234")
PAGE_SIZE = 5
SORTS = [("price", "asc", "Price: Low to High"), ("price", "desc", "Price: High to Low"), ("name", "asc", "Name")]

# ----------------------------------------------------------------------------------------------
# Seed data

CATEGORIES = {  # slug -> title
    "headphones": "Headphones",
    "office-products": "Office Products",
    "kitchen": "Kitchen & Dining",
    "cables": "Cables & Adapters",
}


@dataclass(frozen=True)
class Product:
    sku: str
    name: str
    price: float
    category: str
    description: str

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


PRODUCTS = [Product(*row) for row in [
    ("HP-100", "Sony WH-1000XM4 Wireless Headphones", 278.00, "headphones",
     "Industry-leading noise canceling with 30 hours of battery life."),
    ("HP-101", "Bose QuietComfort 45 Headphones", 249.99, "headphones",
     "Balanced audio and a quiet mode for travel."),
    ("HP-102", "JBL Tune 510BT On-Ear Headphones", 29.95, "headphones",
     "Pure bass sound, foldable, 40 hours of play time."),
    ("HP-103", "Sennheiser HD 280 Pro Studio Headphones", 99.95, "headphones",
     "Closed dynamic monitoring headphones for studio work."),
    ("HP-104", "Anker Soundcore Life Q20 Headphones", 59.99, "headphones",
     "Hybrid active noise canceling with a deep bass mode."),
    ("HP-105", "Audio-Technica ATH-M50x Headphones", 149.00, "headphones",
     "Professional monitor headphones with detachable cables."),
    ("HP-106", "Panasonic ErgoFit Wired Earbuds", 9.99, "headphones",
     "Comfortable in-ear buds with a tangle-free cord."),
    ("OF-200", "Logitech M310 Wireless Mouse", 24.99, "office-products",
     "A full-size ambidextrous mouse with a one-year battery."),
    ("OF-201", "HP OfficeJet 250 Mobile Printer", 279.49, "office-products",
     "Print, scan and copy on the go."),
    ("OF-202", "Swingline Stapler, Commercial Desk", 15.49, "office-products",
     "Staples up to 20 sheets; jam-free."),
    ("OF-203", "Post-it Super Sticky Notes, 12 Pads", 13.99, "office-products",
     "Sticks and re-sticks to walls and monitors."),
    ("OF-204", "Fellowes Paper Shredder", 64.99, "office-products",
     "Cross-cut shredder for 10 sheets at a time."),
    ("OF-205", "AmazonBasics Mesh Desk Organizer", 19.99, "office-products",
     "Five compartments for pens, notes and files."),
    ("KI-300", "Ninja Professional Blender", 89.99, "kitchen",
     "1000 watts, 72 oz pitcher, crushes ice in seconds."),
    ("KI-301", "Lodge Cast Iron Skillet, 12 Inch", 34.90, "kitchen",
     "Pre-seasoned and ready for stovetop, oven or campfire."),
    ("KI-302", "OXO Good Grips Salad Spinner", 29.99, "kitchen",
     "One-handed pump and a brake button."),
    ("KI-303", "Keurig K-Mini Coffee Maker", 79.99, "kitchen",
     "Single serve, fits anywhere, brews 6 to 12 oz."),
    ("KI-304", "Pyrex Glass Measuring Cup Set", 21.49, "kitchen",
     "Three cups: 1, 2 and 4 cup sizes."),
    ("CA-400", "Anker USB-C to USB-A Cable, 6 ft", 11.99, "cables",
     "Braided nylon, fast charging, 480 Mbps data."),
    ("CA-401", "Amazon Basics HDMI Cable, 10 ft", 8.99, "cables",
     "Supports 4K video at 60 Hz and Ethernet."),
    ("CA-402", "UGREEN USB-C Hub 5-in-1", 25.99, "cables",
     "Adds HDMI, three USB 3.0 ports and power delivery."),
    ("CA-403", "Belkin Lightning to USB Cable", 19.99, "cables",
     "Apple MFi certified, 4 ft."),
    ("CA-404", "Cable Matters USB-C to HDMI Adapter", 15.99, "cables",
     "4K 60 Hz output for laptops and tablets."),
]]
BY_SKU = {p.sku: p for p in PRODUCTS}
BY_SLUG = {p.slug: p for p in PRODUCTS}

SEED_REVIEWS = {  # sku -> [(nickname, rating 1-5, summary, text)]
    "OF-200": [("Mike", 5, "Works great", "Battery lasts forever."),
               ("Jenny", 4, "Good value", "A little small for my hand.")],
    "HP-102": [("Tom", 3, "Okay", "Sound is fine, the band is tight.")],
    "KI-300": [("Ana", 5, "Smoothies!", "Crushes ice like nothing."),
               ("Raj", 2, "Loud", "Very loud, but it works."),
               ("Lee", 4, "Solid", "Good blender for the price.")],
}

FORUMS = {  # name -> description
    "gadgets": "Talk about phones, headphones and everything with a battery.",
    "books": "What are you reading?",
    "cooking": "Recipes, techniques and kitchen gear.",
}


@dataclass
class Post:
    id: int
    forum: str
    title: str
    author: str
    body: str
    score: int
    comments: list = field(default_factory=list)  # [(author, text)]

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", self.title.lower()).strip("_")


SEED_POSTS = [Post(*row) for row in [
    (1, "gadgets", "Best budget headphones?", "alice",
     "I want something under $50. The JBL Tune 510BT is on sale at One Stop Market.", 42,
     [("bob", "Get the JBL, the bass is great."), ("carol", "Anker Q20 if you can stretch it.")]),
    (2, "gadgets", "My USB-C hub died after a week", "bob", "Anyone else had this?", 7,
     [("dave", "Return it, mine lasts a year now.")]),
    (3, "gadgets", "Mechanical keyboards are overrated", "carol", "Change my mind.", -3, []),
    (4, "gadgets", "Wireless mouse recommendations", "dave",
     "Looking for a cheap, reliable one.", 15, [("alice", "Logitech M310, never fails.")]),
    (5, "gadgets", "Noise canceling on planes", "erin", "Sony or Bose for long flights?", 23,
     [("frank", "Sony, the battery is better."), ("bob", "Bose is more comfortable.")]),
    (6, "gadgets", "Printer ink prices are a scam", "frank", "Nothing more to say.", 31, []),
    (7, "gadgets", "Which HDMI cable for 4K?", "alice", "Does the brand matter?", 4,
     [("carol", "No, any certified cable works.")]),
    (8, "books", "Just finished Dune", "bob", "What should I read next?", 18,
     [("alice", "Hyperion!"), ("dave", "The Left Hand of Darkness.")]),
    (9, "books", "Audiobooks count as reading", "carol", "Fight me.", 9, []),
    (10, "books", "Best fantasy series of the decade", "dave", "Mine is The Stormlight Archive.", 27,
     [("erin", "The Broken Earth trilogy.")]),
    (11, "books", "Library apps are underrated", "erin", "Libby saved me a fortune.", 12, []),
    (12, "cooking", "Cast iron care tips", "frank", "How do you clean yours?", 20,
     [("alice", "Hot water and a brush, then oil it.")]),
    (13, "cooking", "Blender for smoothies", "alice", "Ninja or Vitamix?", 6,
     [("bob", "Ninja is plenty for smoothies.")]),
    (14, "cooking", "Sourdough starter died", "bob", "Third time this year.", 2, []),
]]


# ----------------------------------------------------------------------------------------------
# A tiny request/response layer over WSGI


class Request:
    def __init__(self, environ):
        self.method = environ["REQUEST_METHOD"]
        self.path = environ.get("PATH_INFO", "/") or "/"
        self.query = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        self.form = {}
        if self.method == "POST":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = environ["wsgi.input"].read(length).decode("utf-8", "replace")
            self.form = {k: v[0] for k, v in parse_qs(body, keep_blank_values=True).items()}
        cookies = SimpleCookie(environ.get("HTTP_COOKIE", ""))
        self.cookies = {k: m.value for k, m in cookies.items()}
        self.set_cookies: list[str] = []


class Response:
    def __init__(self, body: str = "", status: str = "200 OK", location: str | None = None):
        self.body, self.status, self.headers = body, status, [("Content-Type", "text/html; charset=utf-8")]
        if location:
            self.status = "303 See Other"
            self.headers.append(("Location", location))


def redirect(location: str) -> Response:
    return Response(location=location)


def not_found() -> Response:
    return Response(page("404 Not Found", "<h1>Whoops, our bad...</h1><p>The page you requested was not found.</p>"),
                    "404 Not Found")


def e(text) -> str:
    return html.escape(str(text))


def page(title: str, body: str, style: str = "") -> str:
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{e(title)}</title>"
            "<style>body{font-family:sans-serif;margin:0 24px;font-size:16px}"
            "header{padding:12px 0;border-bottom:1px solid #ccc}header a{margin-right:16px}"
            ".item{padding:18px 0;border-bottom:1px solid #eee;min-height:64px}"
            ".price{font-weight:bold}.message{background:#efe;padding:8px}"
            f"{style}</style></head><body>{body}</body></html>")


class App:
    """A WSGI app with per-context sessions (`sid` cookie) and shared logins (`auth` cookie)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sessions: dict[str, dict] = {}
        self.tokens: dict[str, str] = {}  # auth token -> user name
        self.links: dict[str, str] = {}  # site name -> base URL, filled by LocalSites

    def __call__(self, environ, start_response):
        request = Request(environ)
        sid = request.cookies.get("sid")
        with self.lock:
            if sid not in self.sessions:
                sid = secrets.token_hex(8)
                self.sessions[sid] = self.new_session()
                request.set_cookies.append(f"sid={sid}; Path=/; HttpOnly")
            request.session = self.sessions[sid]
            request.user = self.tokens.get(request.cookies.get("auth", ""))
            try:
                response = self.route(request)
            except KeyError:
                response = not_found()
        headers = response.headers + [("Set-Cookie", c) for c in request.set_cookies]
        start_response(response.status, headers)
        return [response.body.encode("utf-8")]

    def login(self, request: Request, user: str) -> None:
        token = secrets.token_hex(12)
        self.tokens[token] = user
        request.set_cookies.append(f"auth={token}; Path=/; HttpOnly; Max-Age=86400")

    def logout(self, request: Request) -> None:
        self.tokens.pop(request.cookies.get("auth", ""), None)
        request.set_cookies.append("auth=; Path=/; Max-Age=0")

    def new_session(self) -> dict:
        return {}

    def route(self, request: Request) -> Response:
        raise NotImplementedError


def pager(base: str, params: dict, page_no: int, pages: int, key: str = "p") -> str:
    links = []
    if page_no > 1:
        links.append(f"<a href='{e(base)}?{e(urlencode({**params, key: page_no - 1}))}'>Previous</a>")
    links.append(f"<span>Page {page_no} of {pages}</span>")
    if page_no < pages:
        links.append(f"<a href='{e(base)}?{e(urlencode({**params, key: page_no + 1}))}'>Next</a>")
    return "<nav aria-label='Pages'>" + " ".join(links) + "</nav>"


# ----------------------------------------------------------------------------------------------
# The shop


class Shop(App):
    def new_session(self) -> dict:
        return {"cart": {}, "orders": [], "reviews": {}, "wishlist": [], "message": ""}

    def layout(self, request: Request, title: str, body: str) -> str:
        s = request.session
        account = ("<a href='/customer/account/'>My Account</a><a href='/wishlist/'>My Wish List</a>"
                   "<a href='/customer/account/logout/'>Sign Out</a>" if request.user
                   else "<a href='/customer/account/login/'>Sign In</a>")
        categories = "".join(f"<a href='/{slug}.html'>{e(name)}</a>" for slug, name in CATEGORIES.items())
        message, s["message"] = s["message"], ""
        return page(title, (
            f"<header><a href='/'>One Stop Market</a>{account}"
            f"<a href='/checkout/cart/'>My Cart ({sum(s['cart'].values())})</a>"
            "<form action='/catalogsearch/result/' method='get' role='search' style='display:inline'>"
            "<label for='search'>Search</label> <input id='search' name='q' type='text'> "
            "<button type='submit'>Search</button></form></header>"
            f"<nav aria-label='Categories'>{categories}</nav>"
            + (f"<div class='message' role='status'>{e(message)}</div>" if message else "")
            + f"<main>{body}</main>"))

    def listing(self, request: Request, products: list[Product], base: str, params: dict, title: str) -> Response:
        order = request.query.get("product_list_order", "")
        direction = request.query.get("product_list_dir", "asc")
        if order in ("price", "name"):
            products = sorted(products, key=lambda p: p.price if order == "price" else p.name,
                              reverse=direction == "desc")
        pages = max(1, -(-len(products) // PAGE_SIZE))
        page_no = min(max(1, int(request.query.get("p", "1") or 1)), pages)
        shown = products[(page_no - 1) * PAGE_SIZE: page_no * PAGE_SIZE]
        sort_links = " ".join(
            f"<a href='{e(base)}?{e(urlencode({**params, 'product_list_order': o, 'product_list_dir': d}))}'>{label}</a>"
            for o, d, label in SORTS)
        keep = {k: v for k, v in request.query.items() if k in ("product_list_order", "product_list_dir")}
        items = "".join(
            f"<li class='item'><a href='/{p.slug}.html'>{e(p.name)}</a> "
            f"<span class='price'>${p.price:,.2f}</span></li>" for p in shown)
        body = (f"<h1>{e(title)}</h1><p>{len(products)} items</p><div>Sort by: {sort_links}</div>"
                f"<ol class='products'>{items}</ol>" + pager(base, {**params, **keep}, page_no, pages))
        return Response(self.layout(request, title, body))

    def reviews(self, request: Request, sku: str) -> list[tuple]:
        return SEED_REVIEWS.get(sku, []) + request.session["reviews"].get(sku, [])

    def product_page(self, request: Request, p: Product) -> Response:
        reviews = self.reviews(request, p.sku)
        rating = f"{sum(r[1] for r in reviews) / len(reviews):.1f} out of 5" if reviews else "No ratings yet"
        review_list = "".join(
            f"<li class='review'><strong>{e(s)}</strong> <span>Rating: {r}/5</span>"
            f"<p>{e(t)}</p><p>Review by {e(n)}</p></li>" for n, r, s, t in reviews)
        rating_options = "".join(f"<option value='{i}'>{i} stars</option>" for i in range(5, 0, -1))
        body = (f"<h1>{e(p.name)}</h1><p class='price'>${p.price:,.2f}</p><p>SKU: {e(p.sku)}</p>"
                f"<p>Rating: {rating} ({len(reviews)} reviews)</p><p>{e(p.description)}</p>"
                f"<form method='post' action='/checkout/cart/add'><input type='hidden' name='sku' value='{e(p.sku)}'>"
                "<label for='qty'>Qty</label> <input id='qty' name='qty' type='number' min='1' placeholder='1'> "
                "<button type='submit'>Add to Cart</button></form>"
                f"<form method='post' action='/wishlist/index/add'><input type='hidden' name='sku' value='{e(p.sku)}'>"
                "<button type='submit'>Add to Wish List</button></form>"
                f"<h2>Customer Reviews</h2><ol class='reviews'>{review_list}</ol>"
                f"<h2>Write Your Own Review</h2><form method='post' action='/review/product/post/{e(p.sku)}'>"
                "<label for='nickname'>Nickname</label> <input id='nickname' name='nickname'><br>"
                "<label for='summary'>Summary</label> <input id='summary' name='summary'><br>"
                "<label for='review'>Review</label> <textarea id='review' name='review'></textarea><br>"
                f"<label for='rating'>Rating</label> <select id='rating' name='rating'>{rating_options}</select><br>"
                "<button type='submit'>Submit Review</button></form>")
        return Response(self.layout(request, p.name, body))

    def cart_total(self, cart: dict) -> float:
        return sum(BY_SKU[sku].price * qty for sku, qty in cart.items())

    def route(self, request: Request) -> Response:
        """Magento's URLs, in the order they are matched: the catalogue, the cart and checkout, signing in and
        out, then (signed in only) the account, orders and wish list, and a review posted."""
        path, post = request.path, request.method == "POST"
        if path == "/":
            return self.home_page(request)
        if path == "/catalogsearch/result/":
            return self.search_page(request)
        if path.endswith(".html") and path[1:-5] in CATEGORIES:
            slug = path[1:-5]
            return self.listing(request, [p for p in PRODUCTS if p.category == slug], path, {}, CATEGORIES[slug])
        if path.endswith(".html") and path[1:-5] in BY_SLUG:
            return self.product_page(request, BY_SLUG[path[1:-5]])
        if path == "/checkout/cart/add" and post:
            return self.add_to_cart(request)
        if path == "/checkout/cart/delete" and post:
            request.session["cart"].pop(request.form["sku"], None)
            return redirect("/checkout/cart/")
        if path == "/checkout/cart/":
            return self.cart_page(request)
        if path == "/checkout/":
            return self.checkout(request)
        if path == "/checkout/onepage/success/":
            return self.success_page(request)
        if path == "/customer/account/login/":
            return self.login_page(request)
        if path == "/customer/account/logout/":
            self.logout(request)
            return redirect("/")
        if not request.user and (path.startswith("/customer/account") or path.startswith("/sales/")
                                 or path.startswith("/wishlist")):
            return redirect("/customer/account/login/")
        if path == "/customer/account/":
            return self.account_page(request)
        if path == "/sales/order/history/":
            return self.orders_page(request)
        match = re.fullmatch(r"/sales/order/view/order_id/(\d+)/", path)
        if match:
            return self.order_page(request, int(match.group(1)))
        if path == "/wishlist/index/add" and post:
            return self.add_to_wishlist(request)
        if path == "/wishlist/":
            return self.wishlist_page(request)
        match = re.fullmatch(r"/review/product/post/([A-Z0-9-]+)", path)
        if match and post:
            return self.add_review(request, BY_SKU[match.group(1)])
        return not_found()

    # -- the catalogue

    def home_page(self, request: Request) -> Response:
        featured = "".join(f"<li class='item'><a href='/{p.slug}.html'>{e(p.name)}</a> "
                           f"<span class='price'>${p.price:,.2f}</span></li>" for p in PRODUCTS[::5])
        return Response(self.layout(request, "One Stop Market", (
            "<h1>One Stop Market</h1><p>Welcome! Browse our categories or search.</p>"
            f"<h2>Featured Products</h2><ul>{featured}</ul>")))

    def search_page(self, request: Request) -> Response:
        q = request.query.get("q", "").strip()
        words = q.lower().split()
        found = [p for p in PRODUCTS if words and all(w in p.name.lower() for w in words)]
        return self.listing(request, found, request.path, {"q": q}, f"Search results for: '{q}'")

    def add_review(self, request: Request, p: Product) -> Response:
        f = request.form
        request.session["reviews"].setdefault(p.sku, []).append(
            (f.get("nickname", ""), int(f.get("rating") or 5), f.get("summary", ""), f.get("review", "")))
        request.session["message"] = "You submitted your review for moderation."
        return redirect(f"/{p.slug}.html")

    # -- the cart and checkout

    def add_to_cart(self, request: Request) -> Response:
        s = request.session
        sku, qty = request.form["sku"], max(1, int(request.form.get("qty") or 1))
        s["cart"][sku] = s["cart"].get(sku, 0) + qty
        s["message"] = f"You added {BY_SKU[sku].name} to your shopping cart."
        return redirect("/checkout/cart/")

    def cart_page(self, request: Request) -> Response:
        cart = request.session["cart"]
        rows = "".join(
            f"<tr><td><a href='/{BY_SKU[sku].slug}.html'>{e(BY_SKU[sku].name)}</a></td><td>Qty: {qty}</td>"
            f"<td>${BY_SKU[sku].price * qty:,.2f}</td><td><form method='post' action='/checkout/cart/delete'>"
            f"<input type='hidden' name='sku' value='{sku}'><button type='submit'>Remove item</button></form></td></tr>"
            for sku, qty in cart.items())
        body = ("<h1>Shopping Cart</h1>" + (
            f"<table class='cart'><tr><th>Item</th><th>Qty</th><th>Subtotal</th><th></th></tr>{rows}</table>"
            f"<p>Order Total: ${self.cart_total(cart):,.2f}</p><a href='/checkout/'>Proceed to Checkout</a>"
            if cart else "<p>You have no items in your shopping cart.</p>"))
        return Response(self.layout(request, "Shopping Cart", body))

    def checkout(self, request: Request) -> Response:
        """The shipping form; posted, it places the order and empties the cart."""
        s = request.session
        if not s["cart"]:
            return redirect("/checkout/cart/")
        if request.method == "POST":
            number = len(s["orders"]) + 1
            s["orders"].append({"number": number, "items": dict(s["cart"]), "total": self.cart_total(s["cart"]),
                                "name": request.form.get("name", ""), "street": request.form.get("street", ""),
                                "city": request.form.get("city", ""), "status": "Pending"})
            s["cart"] = {}
            return redirect(f"/checkout/onepage/success/?order={number}")
        name = SHOP_USER[2] if request.user else ""
        return Response(self.layout(request, "Checkout", (
            "<h1>Checkout</h1><h2>Shipping Address</h2><form method='post' action='/checkout/'>"
            f"<label for='name'>Full Name</label> <input id='name' name='name' value='{e(name)}'><br>"
            "<label for='street'>Street Address</label> <input id='street' name='street'><br>"
            "<label for='city'>City</label> <input id='city' name='city'><br>"
            f"<p>Order Total: ${self.cart_total(s['cart']):,.2f}</p>"
            "<button type='submit'>Place Order</button></form>")))

    def success_page(self, request: Request) -> Response:
        number = int(request.query["order"])
        return Response(self.layout(request, "Success", (
            "<h1>Thank you for your purchase!</h1>"
            f"<p>Your order number is: <a href='/sales/order/view/order_id/{number}/'>{number:09d}</a>.</p>")))

    # -- the customer's account

    def login_page(self, request: Request) -> Response:
        if request.method == "POST":
            if (request.form.get("login[username]"), request.form.get("login[password]")) == SHOP_USER[:2]:
                self.login(request, SHOP_USER[0])
                return redirect("/customer/account/")
            request.session["message"] = "The account sign-in was incorrect or your account is disabled temporarily."
            return redirect("/customer/account/login/")
        return Response(self.layout(request, "Customer Login", (
            "<h1>Customer Login</h1><form method='post' action='/customer/account/login/'>"
            "<label for='email'>Email</label> <input id='email' name='login[username]' type='email'><br>"
            "<label for='pass'>Password</label> <input id='pass' name='login[password]' type='password'><br>"
            "<button type='submit'>Sign In</button></form>")))

    def account_page(self, request: Request) -> Response:
        return Response(self.layout(request, "My Account", (
            f"<h1>My Account</h1><p>{e(SHOP_USER[2])}</p><p>{e(SHOP_USER[0])}</p>"
            "<a href='/sales/order/history/'>My Orders</a> <a href='/wishlist/'>My Wish List</a>")))

    def orders_page(self, request: Request) -> Response:
        rows = "".join(
            f"<tr><td>{o['number']:09d}</td><td>${o['total']:,.2f}</td><td>{o['status']}</td>"
            f"<td><a href='/sales/order/view/order_id/{o['number']}/'>View Order</a></td></tr>"
            for o in reversed(request.session["orders"]))
        return Response(self.layout(request, "My Orders", (
            "<h1>My Orders</h1>" + (f"<table class='orders'><tr><th>Order #</th><th>Order Total</th>"
                                    f"<th>Status</th><th>Action</th></tr>{rows}</table>"
                                    if rows else "<p>You have placed no orders.</p>"))))

    def order_page(self, request: Request, number: int) -> Response:
        orders = request.session["orders"]
        if not 1 <= number <= len(orders):
            return not_found()
        o = orders[number - 1]
        items = "".join(f"<li>{e(BY_SKU[sku].name)} (Qty: {qty})</li>" for sku, qty in o["items"].items())
        return Response(self.layout(request, f"Order # {number:09d}", (
            f"<h1>Order # {number:09d}</h1><p>Status: {o['status']}</p><ul class='order-items'>{items}</ul>"
            f"<div class='shipping'>Ship to: {e(o['name'])}, {e(o['street'])}, {e(o['city'])}</div>"
            f"<p>Grand Total: ${o['total']:,.2f}</p>")))

    def add_to_wishlist(self, request: Request) -> Response:
        s = request.session
        if request.form["sku"] not in s["wishlist"]:
            s["wishlist"].append(request.form["sku"])
        s["message"] = f"{BY_SKU[request.form['sku']].name} has been added to your Wish List."
        return redirect("/wishlist/")

    def wishlist_page(self, request: Request) -> Response:
        items = "".join(f"<li class='item'><a href='/{BY_SKU[sku].slug}.html'>{e(BY_SKU[sku].name)}</a></li>"
                        for sku in request.session["wishlist"])
        return Response(self.layout(request, "My Wish List", (
            f"<h1>My Wish List</h1><ol class='wishlist'>{items}</ol>" if items
            else "<h1>My Wish List</h1><p>You have no items in your wish list.</p>")))


# ----------------------------------------------------------------------------------------------
# The forum


class Forum(App):
    def __init__(self):
        super().__init__()
        self.next_id = len(SEED_POSTS) + 1

    def new_session(self) -> dict:
        return {"posts": [], "comments": {}, "votes": {}}  # votes: post id -> +1/-1

    def posts(self, request: Request) -> list[Post]:
        s = request.session
        out = []
        for p in SEED_POSTS + s["posts"]:
            out.append(Post(p.id, p.forum, p.title, p.author, p.body, p.score + s["votes"].get(p.id, 0),
                            p.comments + s["comments"].get(p.id, [])))
        return out

    def layout(self, request: Request, title: str, body: str) -> str:
        account = (f"<a href='/user/{e(request.user)}'>{e(request.user)}</a><a href='/logout'>Log out</a>"
                   if request.user else "<a href='/login'>Log in</a>")
        return page(title, (
            f"<header><a href='/'>Postmill</a><a href='/forums'>Forums</a>{account}"
            "<form action='/search' method='get' role='search' style='display:inline'>"
            "<label for='q'>Search query</label> <input id='q' name='q' type='search'> "
            "<button type='submit'>Search</button></form></header>"
            f"<main>{body}</main>"))

    def post_list(self, request: Request, posts: list[Post], base: str, title: str, heading: str = "") -> Response:
        posts = sorted(posts, key=lambda p: -p.score)
        pages = max(1, -(-len(posts) // PAGE_SIZE))
        page_no = min(max(1, int(request.query.get("page", "1") or 1)), pages)
        shown = posts[(page_no - 1) * PAGE_SIZE: page_no * PAGE_SIZE]
        items = "".join(
            f"<article class='item'><h2><a href='/f/{p.forum}/{p.id}/{p.slug}'>{e(p.title)}</a></h2>"
            f"<p>Submitted by <a href='/user/{e(p.author)}'>{e(p.author)}</a> in "
            f"<a href='/f/{p.forum}'>f/{p.forum}</a></p><p>{p.score} points · {len(p.comments)} comments</p></article>"
            for p in shown)
        return Response(self.layout(request, title, f"<h1>{e(heading or title)}</h1>{items}"
                                    + pager(base, {}, page_no, pages, key="page")))

    def route(self, request: Request) -> Response:
        """Postmill's URLs, in the order they are matched: the lists, logging in and out, a user's submissions, a
        forum, submitting, and a post with its comment and vote actions."""
        path = request.path
        if path == "/":
            return self.post_list(request, self.posts(request), "/", "Postmill", "Front page")
        if path == "/forums":
            items = "".join(f"<li><a href='/f/{name}'>{name}</a> — {e(desc)}</li>" for name, desc in FORUMS.items())
            return Response(self.layout(request, "Forums", f"<h1>List of forums</h1><ul>{items}</ul>"))
        if path == "/search":
            q = request.query.get("q", "").lower().strip()
            found = [p for p in self.posts(request) if q and q in (p.title + " " + p.body).lower()]
            return self.post_list(request, found, "/search", f"Search results for '{q}'")
        if path == "/login":
            return self.login_page(request)
        if path == "/logout":
            self.logout(request)
            return redirect("/")
        match = re.fullmatch(r"/user/([\w.-]+)", path)
        if match:
            name = match.group(1)
            mine = [p for p in self.posts(request) if p.author == name]
            return self.post_list(request, mine, path, f"{name}'s submissions", f"Submissions by {name}")
        match = re.fullmatch(r"/f/(\w+)", path)
        if match:
            return self.forum_page(request, match.group(1))
        match = re.fullmatch(r"/submit/(\w+)", path)
        if match:
            return self.submit(request, match.group(1))
        match = re.fullmatch(r"/f/(\w+)/(\d+)(?:/[\w-]*)?/?(comment|vote)?", path)
        if match:
            return self.post_page(request, match.group(1), int(match.group(2)), match.group(3))
        return not_found()

    def login_page(self, request: Request) -> Response:
        if request.method == "POST":
            if (request.form.get("_username"), request.form.get("_password")) == FORUM_USER:
                self.login(request, FORUM_USER[0])
                return redirect("/")
            return Response(self.layout(request, "Log in", "<h1>Log in</h1><p role='alert'>Invalid credentials.</p>"))
        return Response(self.layout(request, "Log in", (
            "<h1>Log in</h1><form method='post' action='/login'>"
            "<label for='username'>Username</label> <input id='username' name='_username'><br>"
            "<label for='password'>Password</label> <input id='password' name='_password' type='password'><br>"
            "<button type='submit'>Log in</button></form>")))

    def forum_page(self, request: Request, forum: str) -> Response:
        if forum not in FORUMS:
            return not_found()
        response = self.post_list(request, [p for p in self.posts(request) if p.forum == forum], request.path,
                                  f"f/{forum}")
        submit = f"<a href='/submit/{forum}'>Submit a new post</a>"
        response.body = response.body.replace("<main>", f"<main><p>{e(FORUMS[forum])}</p>{submit}", 1)
        return response

    def submit(self, request: Request, forum: str) -> Response:
        """The submission form (logged in only); posted with a title, it adds the post and shows it."""
        if forum not in FORUMS:
            return not_found()
        if not request.user:
            return redirect("/login")
        if request.method == "POST" and request.form.get("title", "").strip():
            with_id = Post(self.next_id, forum, request.form["title"].strip(), request.user,
                           request.form.get("body", ""), 1)
            self.next_id += 1
            request.session["posts"].append(with_id)
            return redirect(f"/f/{forum}/{with_id.id}/{with_id.slug}")
        return Response(self.layout(request, "Create submission", (
            f"<h1>Create submission in f/{forum}</h1><form method='post' action='/submit/{forum}'>"
            "<label for='title'>Title</label> <input id='title' name='title'><br>"
            "<label for='body'>Body</label> <textarea id='body' name='body'></textarea><br>"
            "<button type='submit'>Create submission</button></form>")))

    def post_page(self, request: Request, forum: str, post_id: int, action: str | None) -> Response:
        """A post with its comments; `action` ("comment" or "vote", posted, logged in only) adds to it first."""
        post = {p.id: p for p in self.posts(request)}.get(post_id)
        if post is None or post.forum != forum:
            return not_found()
        here = f"/f/{post.forum}/{post.id}/{post.slug}"
        if action and request.method == "POST":
            if not request.user:
                return redirect("/login")
            if action == "comment" and request.form.get("comment", "").strip():
                request.session["comments"].setdefault(post.id, []).append(
                    (request.user, request.form["comment"].strip()))
            if action == "vote":
                request.session["votes"][post.id] = 1 if request.form.get("choice") == "1" else -1
            return redirect(here)
        comments = "".join(f"<li class='comment'><p>{e(a)} wrote:</p><p>{e(t)}</p></li>" for a, t in post.comments)
        vote = "".join(f"<form method='post' action='{here}/vote' style='display:inline'>"
                       f"<input type='hidden' name='choice' value='{v}'><button type='submit'>{label}</button></form>"
                       for v, label in (("1", "Upvote"), ("-1", "Downvote")))
        return Response(self.layout(request, post.title, (
            f"<h1>{e(post.title)}</h1><p>Submitted by <a href='/user/{e(post.author)}'>{e(post.author)}</a> "
            f"in <a href='/f/{post.forum}'>f/{post.forum}</a></p>"
            f"<div class='submission__body'>{e(post.body)}</div>"
            f"<p class='vote'>{vote} <span class='score'>{post.score}</span> points</p>"
            f"<h2>{len(post.comments)} comments</h2><ol class='comments'>{comments}</ol>"
            f"<form method='post' action='{here}/comment'><label for='comment'>Comment</label> "
            "<textarea id='comment' name='comment'></textarea> <button type='submit'>Post</button></form>")))


# ----------------------------------------------------------------------------------------------
# The homepage and the fault-test pages


class Homepage(App):
    def __init__(self):
        super().__init__()
        self.release = threading.Event()  # set at shutdown so that /test/slow stops waiting

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO") == "/test/slow":  # outside the app lock: other requests go on
            self.release.wait(120)
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [page("Slow", "<p>Finally.</p>").encode()]
        return super().__call__(environ, start_response)

    def route(self, request: Request) -> Response:
        if request.path == "/":
            return Response(page("Homepage", (
                "<h1>Welcome to the websites</h1><ul>"
                f"<li><a href='{e(self.links['shopping'])}/'>One Stop Market</a>: an online shop</li>"
                f"<li><a href='{e(self.links['reddit'])}/'>Postmill</a>: a forum</li></ul>")))
        if request.path == "/test/freeze":
            return Response(page("Freeze", "<button onclick='while (true) {}'>Freeze</button>"))
        if request.path == "/test/external":
            return Response(page("External", (
                "<img src='http://example.com/pixel.png' alt='pixel'>"
                "<a href='http://example.com/'>Outside link</a> <a href='file:///etc/passwd'>Local file</a>")))
        if request.path == "/test/long":  # 400 small links, all inside the viewport
            links = " ".join(f"<a href='#{i}'>link number {i} of a long page</a>" for i in range(400))
            return Response(page("Long", f"<p style='font-size:6px'>{links}</p>"))
        return not_found()


# ----------------------------------------------------------------------------------------------
# Serving


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args):
        pass


class LocalSites:
    """The three local sites, each on an ephemeral port of 127.0.0.1, until close()."""

    def __init__(self):
        self.apps = {"shopping": Shop(), "reddit": Forum(), "homepage": Homepage()}
        self.servers = {name: make_server("127.0.0.1", 0, app, server_class=_Server, handler_class=_QuietHandler)
                        for name, app in self.apps.items()}
        self.urls = {name: f"http://127.0.0.1:{server.server_port}" for name, server in self.servers.items()}
        for app in self.apps.values():
            app.links = self.urls
        for server in self.servers.values():
            threading.Thread(target=server.serve_forever, daemon=True, name="webarena-site").start()

    def close(self) -> None:
        self.apps["homepage"].release.set()
        for server in self.servers.values():
            server.shutdown()
            server.server_close()


_SITES: LocalSites | None = None
_SITES_LOCK = threading.Lock()


def local_sites() -> LocalSites:
    """The process's local sites, started on first use."""
    global _SITES
    with _SITES_LOCK:
        if _SITES is None:
            _SITES = LocalSites()
        return _SITES

